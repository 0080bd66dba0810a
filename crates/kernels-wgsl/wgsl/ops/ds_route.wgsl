// DeepSeek's router (`DeepseekV4TopKRouter` / `DeepseekV4HashRouter`), one workgroup per token
// row: the scores `s = score(logits / temp)` (0 softmax, 1 sigmoid, 2 sqrt(softplus)) written
// back over the logits; the experts: `hash` = 1 takes `table[token * k ..]`, else the top-k of
// `s + bias` (the bias only selects; equal keys keep the lower expert id first, as the CPU's
// stable sort); the weights `s[x] / (sum of the chosen s + 1e-20) * scale`, summed in the
// chosen order. Writes `ids` and `wts` `[nt, k]`.
struct Params {
    e: u32,
    k: u32,
    scoring: u32,
    hash: u32,
    temp: u32,
    scale: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> table: array<u32>;
@group(0) @binding(5) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(6) var<storage, read_write> ids: array<u32>;
@group(0) @binding(7) var<storage, read_write> wts: array<f32>;

const MAXK: u32 = 64u;
var<workgroup> chosen: array<u32, 64>;

// log(1 + v) for 0 <= v <= 1 by the series of 2 atanh(z), z = v / (2 + v) <= 1/3, to ~1e-11:
// `log` itself may be off by 2^-21 absolutely near 1 (Vulkan's bound), which is a relative
// error of 1e-3 in a small score (seen on lavapipe).
fn log1p_small(v: f32) -> f32 {
    let z = v / (2.0 + v);
    let z2 = z * z;
    var term = z;
    var acc = 0.0;
    for (var n = 1u; n <= 21u; n += 2u) {
        acc += term / f32(n);
        term *= z2;
    }
    return 2.0 * acc;
}

fn score(v: f32) -> f32 {
    if (P.scoring == 1u) {
        return sigmoid(v);
    }
    // sqrt(softplus(v)), softplus as torch's (threshold 20), as max(v, 0) + log1p(exp(-|v|)).
    if (v > 20.0) {
        return sqrt(v);
    }
    return sqrt(max(v, 0.0) + log1p_small(exp(-abs(v))));
}

fn taken(x: u32, n: u32) -> bool {
    for (var i = 0u; i < n; i++) {
        if (chosen[i] == x) {
            return true;
        }
    }
    return false;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wid.x;
    let e = P.e;
    let k = P.k;
    let row = t * e;
    let temp = bitcast<f32>(P.temp);
    if (P.scoring == 0u) {
        var mx = NEG;
        for (var x = li; x < e; x += WG) {
            mx = max(mx, logits[row + x] / temp);
        }
        mx = max_wg(mx, li);
        var z = 0.0;
        for (var x = li; x < e; x += WG) {
            let v = exp(logits[row + x] / temp - mx);
            logits[row + x] = v;
            z += v;
        }
        z = sum_wg(z, li);
        for (var x = li; x < e; x += WG) {
            logits[row + x] = logits[row + x] / z;
        }
    } else {
        for (var x = li; x < e; x += WG) {
            logits[row + x] = score(logits[row + x] / temp);
        }
    }
    storageBarrier();
    if (P.hash == 1u) {
        if (li < k) {
            chosen[li] = table[tokens[t] * k + li];
        }
    } else {
        for (var i = 0u; i < k; i++) {
            var best = NEG;
            var at = 0xffffffffu;
            for (var x = li; x < e; x += WG) {
                let v = logits[row + x] + bias[x];
                if ((v > best || at == 0xffffffffu) && !taken(x, i)) {
                    best = v;
                    at = x;
                }
            }
            let pick = argmax_wg(select(best, NEG, at == 0xffffffffu), at, li);
            if (li == 0u) {
                chosen[i] = pick;
            }
            workgroupBarrier();
        }
    }
    workgroupBarrier();
    if (li == 0u) {
        var sum = 0.0;
        for (var i = 0u; i < k; i++) {
            sum += logits[row + chosen[i]];
        }
        let scale = bitcast<f32>(P.scale);
        for (var i = 0u; i < k; i++) {
            ids[t * k + i] = chosen[i];
            wts[t * k + i] = logits[row + chosen[i]] / (sum + 1e-20) * scale;
        }
    }
}

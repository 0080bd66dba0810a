// DeepSeek-V4.1's Engram module after its `wkv` projection (model-dsv4's `engram::block`), one
// workgroup per (stream k, token row r): `kv` `[nt, (N+1)*D]` holds the row's N keys and its
// value; `dot = sum(h_k * qk_k * key_k) / (rms(h_k) rms(key_k) sqrt(D))` (eps inside the
// roots), `gate = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6)))`, `h_k += gate * value` on the
// streams `x` `[nt, N, D]`.
struct Params {
    n: u32,
    d: u32,
    eps: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> kv: array<f32>;
@group(0) @binding(3) var<storage, read_write> qk: array<f32>;
@group(0) @binding(4) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let k = wid.x;
    let r = wid.y;
    let n = P.n;
    let d = P.d;
    let eps = bitcast<f32>(P.eps);
    let key0 = r * (n + 1u) * d + k * d;
    let val0 = r * (n + 1u) * d + n * d;
    let h0 = (r * n + k) * d;
    var hh = 0.0;
    var kk = 0.0;
    var hk = 0.0;
    for (var j = li; j < d; j += WG) {
        let h = x[h0 + j];
        let key = kv[key0 + j];
        hh += h * h;
        kk += key * key;
        hk += h * qk[k * d + j] * key;
    }
    let ms_h = sum_wg(hh, li) / f32(d);
    let ms_k = sum_wg(kk, li) / f32(d);
    let dot0 = sum_wg(hk, li);
    let rstd = (1.0 / sqrt(ms_h + eps)) * (1.0 / sqrt(ms_k + eps));
    let dot = dot0 * rstd * (1.0 / sqrt(f32(d)));
    var g = sqrt(max(abs(dot), 1e-6));
    if (dot < 0.0) {
        g = -g;
    }
    let gate = sigmoid(g);
    for (var j = li; j < d; j += WG) {
        x[h0 + j] = x[h0 + j] + gate * kv[val0 + j];
    }
}

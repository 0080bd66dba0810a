// The f32 activation path: activations as f32 vec4s ([nt, cols]).
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;

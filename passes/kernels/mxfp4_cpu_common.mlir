{#- Pieces shared by the linalg MXFP4 kernels for CPUs without AVX-512 (passes/mxfp4_cpu.py says why). -#}

{#- The contraction body's decode. Inputs %w8 (i8 byte), %s (i32 scale byte). Defines %lo, %hi (the two
    nibbles' E2M1 values * 2^-14), %f and %gf (the block factor f * g) and %fnz (-0.0). -#}
{% macro decode() %}
      %sh9 = arith.constant 9 : i16
      %sh12 = arith.constant 12 : i16
      %sh5 = arith.constant 5 : i16
      %sh8 = arith.constant 8 : i16
      %m0e00 = arith.constant 3584 : i16      // 0x0E00: f16 bits 11..9 <- e1 e0 m
      %m8000 = arith.constant -32768 : i16    // 0x8000: f16 sign
      %c23 = arith.constant 23 : i32
      %c1 = arith.constant 1 : i32
      %c126 = arith.constant 126 : i32
      // E2M1 -> f16 bits: value * 2^-14 exactly (e == 0 -> f16 subnormal / zero)
      %w16 = arith.extui %w8 : i8 to i16
      %la = arith.shli %w16, %sh9 : i16       // low nibble: bits 2..0 -> 11..9
      %la2 = arith.andi %la, %m0e00 : i16
      %lb = arith.shli %w16, %sh12 : i16      // low nibble sign: bit 3 -> 15
      %lb2 = arith.andi %lb, %m8000 : i16
      %lh = arith.ori %la2, %lb2 : i16
      %lhf = arith.bitcast %lh : i16 to f16
      %lo = arith.extf %lhf : f16 to f32
      %ha = arith.shli %w16, %sh5 : i16       // high nibble: bits 6..4 -> 11..9
      %ha2 = arith.andi %ha, %m0e00 : i16
      %hb = arith.shli %w16, %sh8 : i16       // high nibble sign: bit 7 -> 15
      %hb2 = arith.andi %hb, %m8000 : i16
      %hh = arith.ori %ha2, %hb2 : i16
      %hhf = arith.bitcast %hh : i16 to f16
      %hi = arith.extf %hhf : f16 to f32
      // block factor 2^(s-127) = g * f with f = 2^(max(s,1)-127), g = (s == 0 ? 1/2 : 1): both normal
      // f32 for every s in 0..254 (2^-127 alone is subnormal and DAZ would read it as 0), built as bits
      %s1 = arith.maxui %s, %c1 : i32
      %fb = arith.shli %s1, %c23 : i32
      %f = arith.bitcast %fb : i32 to f32
      %sl = arith.minui %s, %c1 : i32
      %sg = arith.addi %sl, %c126 : i32
      %gb = arith.shli %sg, %c23 : i32
      %gf = arith.bitcast %gb : i32 to f32
      %fnz = arith.constant -0.0 : f32
{% endmacro %}

{#- %xe, %xo : tensor<lead x G x 16 x f32> from src : tensor<lead x 32G x f32>, times 2^14.
    d: the generic's dim names ("m, g, b"), assoc / out_shape: the expand_shape's, par: its iterators. -#}
{% macro deinterleave(src, x_t, xs, xs5, d, assoc, out_shape, par) %}
  // de-interleave x: xe[.., g, b] = x[.., 32g + 2b] * 2^14, xo[.., g, b] = x[.., 32g + 2b + 1] * 2^14
  %xr = tensor.expand_shape {{src}} [{{assoc}}] output_shape [{{out_shape}}]
      : {{x_t}} into tensor<{{xs5}}xf32>
  %xe, %xo = flow.dispatch.region -> (tensor<{{xs}}xf32>, tensor<{{xs}}xf32>) {
  %xe0 = tensor.empty() : tensor<{{xs}}xf32>
  %xeo:2 = linalg.generic {indexing_maps = [affine_map<({{d}}) -> ({{d}}, 0)>, affine_map<({{d}}) -> ({{d}}, 1)>,
                                            affine_map<({{d}}) -> ({{d}})>, affine_map<({{d}}) -> ({{d}})>],
                           iterator_types = [{{par}}]}
      ins(%xr, %xr : tensor<{{xs5}}xf32>, tensor<{{xs5}}xf32>) outs(%xe0, %xe0 : tensor<{{xs}}xf32>, tensor<{{xs}}xf32>) {
    ^bb0(%a: f32, %b: f32, %o1: f32, %o2: f32):
      // x * 2^14 (exact): cancels the 2^-14 of the f16 weight decode, so x * w is at its true scale
      %c2p14 = arith.constant 16384.0 : f32
      %as = arith.mulf %a, %c2p14 : f32
      %bs = arith.mulf %b, %c2p14 : f32
      linalg.yield %as, %bs : f32, f32
  } -> (tensor<{{xs}}xf32>, tensor<{{xs}}xf32>)
  flow.return %xeo#0, %xeo#1 : tensor<{{xs}}xf32>, tensor<{{xs}}xf32>
  }
{% endmacro %}

{#- %y = %src reshaped through one flat dim of `total` elements from `full` to `part` (both "AxBxC"). -#}
{% macro reflat(y, src, element, full, part, total) %}
{% set n_full, n_part = full.split("x") | length, part.split("x") | length %}
  %{{y}}0 = tensor.collapse_shape {{src}} [[{{ range(n_full) | join(", ") }}]] : tensor<{{full}}x{{element}}> into tensor<{{total}}x{{element}}>
  %{{y}} = tensor.expand_shape %{{y}}0 [[{{ range(n_part) | join(", ") }}]] output_shape [{{ part.replace("x", ", ") }}] : tensor<{{total}}x{{element}}> into tensor<{{part}}x{{element}}>
{% endmacro %}

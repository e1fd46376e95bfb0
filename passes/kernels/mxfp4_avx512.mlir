{#- The x86 MXFP4 dispatch (passes/mxfp4_avx512.py says why and how), in two ISA forms: width 16 (AVX-512:
    vpermd looks up the 16 signed values) and width 8 (AVX2: vpermps looks up the 8 magnitudes, the sign
    bit xor-ed in; each block's 16 bytes as two halves of 8).
    rows:     {{name}}_rows(x [R, K], packed [E, O, K/2] i8, scales [E, O, K/32] i8, experts [R] i64) -> [R, O]
    form:     "gathered": {{name}}(x [N, J, K], packed, scales, experts [N, J] i64) -> [N, J, O]
              "batched":  {{name}}(x [M, E, K], packed, scales) -> [M, E, O], column e through expert e
    params:   name, form, R, K, O, E, N, J, M, o_tile, n (rows sharing a decode), width, table, table_half,
              row_scales (build a row's scales before its loop), prefetch (rows ahead; 0: none) -#}
{% import "row_runs.mlir" as runs %}
{% set G, K2 = K // 32, K // 2 %}
{% set rows = name ~ "_rows" %}
{% set run_sizes = [n, 2, 1] | unique | select("le", n) | list %}
{% set xt, pt, st = "tensor<%dx%dxf32>" % (R, K), "tensor<%dx%dx%dxi8>" % (E, O, K2), "tensor<%dx%dx%dxi8>" % (E, O, G) %}
{% set half_t, ids_t, yt = "tensor<%dx%dx16xf32>" % (R, G), "tensor<%dxi32>" % R, "tensor<%dx%dxf32>" % (R, O) %}
{% macro block_loop(n, fast, tag) %}
{% set tab = "%table" if fast else "%tab" %}
          %acc{{tag}}:{{n}} = scf.for %g = %c0 to %c_g step %c1 iter_args({% for i in range(n) %}%a{{i}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({% for i in range(n) %}vector<{{width}}xf32>{{ ", " if not loop.last }}{% endfor %}) {
              %g16 = arith.muli %g, %c16 : index
{% if fast %}
              // the row's scales, built before the loop (no scale is 0 here)
              %fs = memref.load %row_scales[%g] : memref<{{G}}xf32>
{% else %}
              // scale 2^(s-127) = f32 bits max(s,1) << 23, times the table's 1/2 when s == 0
              %s8 = memref.load %sc[%e, %o, %g] : memref<{{E}}x{{O}}x{{G}}xi8>
              %s = arith.extui %s8 : i8 to i32
              %s_zero = arith.cmpi eq, %s, %c0_i32 : i32
              %tab = arith.select %s_zero, %table_half, %table : vector<{{width}}xi32>
              %s1 = arith.maxui %s, %c1_i32 : i32
              %fbits = arith.shli %s1, %c23_i32 : i32
              %fs = arith.bitcast %fbits : i32 to f32
{% endif %}
              %f = vector.broadcast %fs : f32 to vector<{{width}}xf32>
{% if width == 16 %}
              // block g of row o: 16 bytes -> 32-bit lanes (low nibble in bits 0..3), high nibble
              %w = vector.load %pk[%e, %o, %g16] : memref<{{E}}x{{O}}x{{K2}}xi8>, vector<16xi8>
              %code_lo = arith.extui %w : vector<16xi8> to vector<16xi32>
              %code_hi = arith.shrui %code_lo, %four : vector<16xi32>
              // vpermd: lane b <- table[code_b & 15]
              %lo_bits = llvm.call_intrinsic "llvm.x86.avx512.permvar.si.512"({{tab}}, %code_lo) : (vector<16xi32>, vector<16xi32>) -> vector<16xi32>
              %hi_bits = llvm.call_intrinsic "llvm.x86.avx512.permvar.si.512"({{tab}}, %code_hi) : (vector<16xi32>, vector<16xi32>) -> vector<16xi32>
              %lo = arith.bitcast %lo_bits : vector<16xi32> to vector<16xf32>
              %hi = arith.bitcast %hi_bits : vector<16xi32> to vector<16xf32>
{% for i in range(n) %}
              %row{{i}} = arith.addi %r, %c{{i}} : index
              %xe{{i}} = vector.load %xe[%row{{i}}, %g, %c0] : memref<{{R}}x{{G}}x16xf32>, vector<16xf32>
              %xo{{i}} = vector.load %xo[%row{{i}}, %g, %c0] : memref<{{R}}x{{G}}x16xf32>, vector<16xf32>
              %p{{i}} = arith.mulf %lo, %xe{{i}} : vector<16xf32>
              %q{{i}} = math.fma %hi, %xo{{i}}, %p{{i}} : vector<16xf32>
              %b{{i}} = math.fma %q{{i}}, %f, %a{{i}} : vector<16xf32>
{% endfor %}
{% else %}
              %tab_f = arith.bitcast {{tab}} : vector<8xi32> to vector<8xf32>
{% for h in range(2) %}
              // bytes {{8 * h}}..{{8 * h + 7}} of block g: vpermps on the low 3 bits, xor (code << 28): the sign (`_table`)
              %at{{h}} = arith.addi %g16, %c{{8 * h}} : index
              %w{{h}} = vector.load %pk[%e, %o, %at{{h}}] : memref<{{E}}x{{O}}x{{K2}}xi8>, vector<8xi8>
              %code_lo{{h}} = arith.extui %w{{h}} : vector<8xi8> to vector<8xi32>
              %code_hi{{h}} = arith.shrui %code_lo{{h}}, %four : vector<8xi32>
{% for part in ("lo", "hi") %}
              %{{part}}_mag{{h}} = llvm.call_intrinsic "llvm.x86.avx2.permps"(%tab_f, %code_{{part}}{{h}}) : (vector<8xf32>, vector<8xi32>) -> vector<8xf32>
              %{{part}}_sign{{h}} = arith.shli %code_{{part}}{{h}}, %shift28 : vector<8xi32>
              %{{part}}_mag_bits{{h}} = arith.bitcast %{{part}}_mag{{h}} : vector<8xf32> to vector<8xi32>
              %{{part}}_bits{{h}} = arith.xori %{{part}}_mag_bits{{h}}, %{{part}}_sign{{h}} : vector<8xi32>
              %{{part}}{{h}} = arith.bitcast %{{part}}_bits{{h}} : vector<8xi32> to vector<8xf32>
{% endfor %}
{% endfor %}
{% for i in range(n) %}
              %row{{i}} = arith.addi %r, %c{{i}} : index
              %xe0_{{i}} = vector.load %xe[%row{{i}}, %g, %c0] : memref<{{R}}x{{G}}x16xf32>, vector<8xf32>
              %xo0_{{i}} = vector.load %xo[%row{{i}}, %g, %c0] : memref<{{R}}x{{G}}x16xf32>, vector<8xf32>
              %xe1_{{i}} = vector.load %xe[%row{{i}}, %g, %c8] : memref<{{R}}x{{G}}x16xf32>, vector<8xf32>
              %xo1_{{i}} = vector.load %xo[%row{{i}}, %g, %c8] : memref<{{R}}x{{G}}x16xf32>, vector<8xf32>
              %p{{i}} = arith.mulf %lo0, %xe0_{{i}} : vector<8xf32>
              %q{{i}} = math.fma %hi0, %xo0_{{i}}, %p{{i}} : vector<8xf32>
              %t{{i}} = math.fma %lo1, %xe1_{{i}}, %q{{i}} : vector<8xf32>
              %u{{i}} = math.fma %hi1, %xo1_{{i}}, %t{{i}} : vector<8xf32>
              %b{{i}} = math.fma %u{{i}}, %f, %a{{i}} : vector<8xf32>
{% endfor %}
{% endif %}
              scf.yield {% for i in range(n) %}%b{{i}}{{ ", " if not loop.last }}{% endfor %} : {% for i in range(n) %}vector<{{width}}xf32>{{ ", " if not loop.last }}{% endfor %}

          }
{% endmacro %}
{% macro rows_body(n) %}
{% if prefetch %}
{{ runs.next_run_expert(R, n) }}
{% endif %}
        scf.for %oi = %c0 to %c_otile step %c1 {
          %o = arith.addi %o_base, %oi : index
{% if prefetch %}
          // the weights and scales of the row {{prefetch}} ahead (row_runs.mlir `ahead`)
{{ runs.ahead() }}
{% for line in range(0, K2, 64) %}
          %pf_at{{line}} = arith.constant {{line}} : index
          memref.prefetch %pk[%e_pf, %o_pf, %pf_at{{line}}], read, locality<3>, data : memref<{{E}}x{{O}}x{{K2}}xi8>
{% endfor %}
          memref.prefetch %sc[%e_pf, %o_pf, %c0], read, locality<3>, data : memref<{{E}}x{{O}}x{{G}}xi8>
{% endif %}
{% if row_scales %}
          // the row's block scales 2^(s-127) as f32 (bits s << 23) in one pass of vector ops, and whether
          // any is 0 (2^-127, below the normal range: that row takes the per-block form with the halved table)
          %any_zero = scf.for %sg = %c0 to %c_g step %c_width iter_args(%z = %false) -> (i1) {
            %s8v = vector.load %sc[%e, %o, %sg] : memref<{{E}}x{{O}}x{{G}}xi8>, vector<{{width}}xi8>
            %sv = arith.extui %s8v : vector<{{width}}xi8> to vector<{{width}}xi32>
            %fbv = arith.shli %sv, %c23v : vector<{{width}}xi32>
            %fv = arith.bitcast %fbv : vector<{{width}}xi32> to vector<{{width}}xf32>
            vector.store %fv, %row_scales[%sg] : memref<{{G}}xf32>, vector<{{width}}xf32>
            %zv = arith.cmpi eq, %sv, %zero_i32v : vector<{{width}}xi32>
            %zr = vector.reduction <or>, %zv : vector<{{width}}xi1> into i1
            %z2 = arith.ori %z, %zr : i1
            scf.yield %z2 : i1
          }
          %acc:{{n}} = scf.if %any_zero -> ({% for i in range(n) %}vector<{{width}}xf32>{{ ", " if not loop.last }}{% endfor %}) {
{{ block_loop(n, False, "s") }}
            scf.yield {% for i in range(n) %}%accs#{{i}}{{ ", " if not loop.last }}{% endfor %} : {% for i in range(n) %}vector<{{width}}xf32>{{ ", " if not loop.last }}{% endfor %}

          } else {
{{ block_loop(n, True, "f") }}
            scf.yield {% for i in range(n) %}%accf#{{i}}{{ ", " if not loop.last }}{% endfor %} : {% for i in range(n) %}vector<{{width}}xf32>{{ ", " if not loop.last }}{% endfor %}

          }
{% else %}
{{ block_loop(n, False, "") }}
{% endif %}
{% for i in range(n) %}
          %sum{{i}} = vector.reduction <add>, %acc#{{i}} : vector<{{width}}xf32> into f32
          %ro{{i}} = arith.addi %r, %c{{i}} : index
          memref.store %sum{{i}}, %y[%ro{{i}}, %o] : memref<{{R}}x{{O}}xf32>
{% endfor %}
        }
{% endmacro %}
stream.executable private @{{rows}}_dispatch {
  stream.executable.export public @{{rows}} workgroups() -> (index, index, index) {
    %x = arith.constant {{O // o_tile}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{rows}}(%xe_b: !stream.binding, %xo_b: !stream.binding, %pk_b: !stream.binding, %sc_b: !stream.binding,
                    %ex_b: !stream.binding, %y_b: !stream.binding) {
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
{% for i in range(2, n + 1) %}
        %c{{i}} = arith.constant {{i}} : index
{% endfor %}
        %c16 = arith.constant 16 : index
        %c_rows = arith.constant {{R}} : index
        %c_otile = arith.constant {{o_tile}} : index
        %c_g = arith.constant {{G}} : index
        %c_last_expert = arith.constant {{E - 1}} : index
        %c0_i32 = arith.constant 0 : i32
{% if prefetch %}
        %c_pf = arith.constant {{prefetch}} : index
        %c_last_row = arith.constant {{R - 1}} : index
        %c_last_o = arith.constant {{O - 1}} : index
{% endif %}
{% if row_scales %}
        %zero_i32v = arith.constant dense<0> : vector<{{width}}xi32>
        %false = arith.constant false
        %c_width = arith.constant {{width}} : index
        %c23v = arith.constant dense<23> : vector<{{width}}xi32>
        %row_scales = memref.alloca() : memref<{{G}}xf32>
{% endif %}
        %c1_i32 = arith.constant 1 : i32
        %c23_i32 = arith.constant 23 : i32
        %four = arith.constant dense<4> : vector<{{width}}xi32>
        %zero = arith.constant dense<0.0> : vector<{{width}}xf32>
        %table = arith.constant {{table}}
        %table_half = arith.constant {{table_half}}
{% if width == 8 %}
        %shift28 = arith.constant dense<28> : vector<8xi32>
        %c8 = arith.constant 8 : index
{% endif %}
        %xe = stream.binding.subspan %xe_b[%c0] : !stream.binding -> memref<{{R}}x{{G}}x16xf32>
        %xo = stream.binding.subspan %xo_b[%c0] : !stream.binding -> memref<{{R}}x{{G}}x16xf32>
        %pk = stream.binding.subspan %pk_b[%c0] : !stream.binding -> memref<{{E}}x{{O}}x{{K2}}xi8>
        %sc = stream.binding.subspan %sc_b[%c0] : !stream.binding -> memref<{{E}}x{{O}}x{{G}}xi8>
        %ex = stream.binding.subspan %ex_b[%c0] : !stream.binding -> memref<{{R}}xi32>
        %y = stream.binding.subspan %y_b[%c0] : !stream.binding -> memref<{{R}}x{{O}}xf32>
        %wg = stream.dispatch.workgroup.id[0] : index
        %o_base = arith.muli %wg, %c_otile : index
{{ runs.walk_rows(R, run_sizes, rows_body) }}
        return
    }
  }
}

util.func private @{{rows}}(%x: {{xt}}, %packed: {{pt}}, %scales: {{st}}, %experts: tensor<{{R}}xi64>) -> {{yt}} {
  // de-interleave x: x_even[r, g, b] = x[r, 32g + 2b], x_odd[r, g, b] = x[r, 32g + 2b + 1]
  %pairs = tensor.expand_shape %x [[0], [1, 2, 3]] output_shape [{{R}}, {{G}}, 16, 2] : {{xt}} into tensor<{{R}}x{{G}}x16x2xf32>
  %h0 = tensor.empty() : {{half_t}}
  %halves:2 = linalg.generic {indexing_maps = [affine_map<(r, g, b) -> (r, g, b, 0)>, affine_map<(r, g, b) -> (r, g, b, 1)>,
                                              affine_map<(r, g, b) -> (r, g, b)>, affine_map<(r, g, b) -> (r, g, b)>],
                              iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%pairs, %pairs : tensor<{{R}}x{{G}}x16x2xf32>, tensor<{{R}}x{{G}}x16x2xf32>) outs(%h0, %h0 : {{half_t}}, {{half_t}}) {
    ^bb0(%a: f32, %b: f32, %o1: f32, %o2: f32):
      linalg.yield %a, %b : f32, f32
  } -> ({{half_t}}, {{half_t}})
{{ runs.ids_i32("%experts", "%ids", R) }}
  %y = flow.dispatch @{{rows}}_dispatch::@{{rows}}(%halves#0, %halves#1, %packed, %scales, %ids)
      : ({{half_t}}, {{half_t}}, {{pt}}, {{st}}, {{ids_t}}) -> {{yt}}
  util.return %y : {{yt}}
}
{% if form == "gathered" %}

util.func private @{{name}}(%x: tensor<{{N}}x{{J}}x{{K}}xf32>, %packed: {{pt}}, %scales: {{st}}, %experts: tensor<{{N}}x{{J}}xi64>) -> tensor<{{N}}x{{J}}x{{O}}xf32> {
  %xr = tensor.collapse_shape %x [[0, 1], [2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into {{xt}}
  %er = tensor.collapse_shape %experts [[0, 1]] : tensor<{{N}}x{{J}}xi64> into tensor<{{R}}xi64>
  %yr = util.call @{{rows}}(%xr, %packed, %scales, %er) : ({{xt}}, {{pt}}, {{st}}, tensor<{{R}}xi64>) -> {{yt}}
  %y = tensor.expand_shape %yr [[0, 1], [2]] output_shape [{{N}}, {{J}}, {{O}}] : {{yt}} into tensor<{{N}}x{{J}}x{{O}}xf32>
  util.return %y : tensor<{{N}}x{{J}}x{{O}}xf32>
}
{% else %}

util.func private @{{name}}(%x: tensor<{{M}}x{{E}}x{{K}}xf32>, %packed: {{pt}}, %scales: {{st}}) -> tensor<{{M}}x{{E}}x{{O}}xf32> {
  // expert-major rows: E runs of M rows, each run sharing its decodes
  %xt0 = tensor.empty() : tensor<{{E}}x{{M}}x{{K}}xf32>
  %xt = linalg.transpose ins(%x : tensor<{{M}}x{{E}}x{{K}}xf32>) outs(%xt0 : tensor<{{E}}x{{M}}x{{K}}xf32>) permutation = [1, 0, 2]
  %xr = tensor.collapse_shape %xt [[0, 1], [2]] : tensor<{{E}}x{{M}}x{{K}}xf32> into {{xt}}
  %e0 = tensor.empty() : tensor<{{R}}xi64>
  %er = linalg.generic {indexing_maps = [affine_map<(r) -> (r)>], iterator_types = ["parallel"]}
      outs(%e0 : tensor<{{R}}xi64>) {
    ^bb0(%out: i64):
      %r = linalg.index 0 : index
      %rows = arith.constant {{M}} : index
      %e = arith.divui %r, %rows : index
      %e64 = arith.index_cast %e : index to i64
      linalg.yield %e64 : i64
  } -> tensor<{{R}}xi64>
  %yr = util.call @{{rows}}(%xr, %packed, %scales, %er) : ({{xt}}, {{pt}}, {{st}}, tensor<{{R}}xi64>) -> {{yt}}
  %ye = tensor.expand_shape %yr [[0, 1], [2]] output_shape [{{E}}, {{M}}, {{O}}] : {{yt}} into tensor<{{E}}x{{M}}x{{O}}xf32>
  %y0 = tensor.empty() : tensor<{{M}}x{{E}}x{{O}}xf32>
  %y = linalg.transpose ins(%ye : tensor<{{E}}x{{M}}x{{O}}xf32>) outs(%y0 : tensor<{{M}}x{{E}}x{{O}}xf32>) permutation = [1, 0, 2]
  util.return %y : tensor<{{M}}x{{E}}x{{O}}xf32>
}
{% endif %}

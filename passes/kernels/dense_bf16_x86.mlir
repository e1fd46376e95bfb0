{#- The x86 bf16 routed-pairs dispatch (passes/weights.py `dense_rows_function` says why): rows r through
    expert experts[r] of a bf16 weight [E, O, K]; with the MXFP4 dispatch's row walk (row_runs.mlir), a
    run of n, else 2, else 1 rows with one expert shares each weight vector's load and widening, and each of
    its rows' vectors serves `ot` outputs (a tile of run x ot partial sums). Width 16 (AVX-512) or 8 (AVX2)
    floats a vector.
    rows:     {{name}}_rows(x [R, K] f32, weight [E, O, K] bf16, experts [R] i64) -> [R, O]
    wrapper:  {{name}}(x [N, J, K], weight, experts [N, J] i64) -> [N, J, O]
    params:   name, N, J, R, K, O, E, o_tile, n, ot (outputs a tile; divides o_tile), width, dot ("f32", or
              "bf16": the rows rounded to bf16 here and multiplied by `vdpbf16ps`, bf16_tile.mlir) -#}
{% import "row_runs.mlir" as runs %}
{% set rows = name ~ "_rows" %}
{% set run_sizes = [n, 2, 1] | unique | select("le", n) | list %}
{% set xe = "i16" if dot == "bf16" else "f32" %}
{% set xt, wt, yt, ids_t = "tensor<%dx%dx%s>" % (R, K, xe), "tensor<%dx%dx%dxbf16>" % (E, O, K), "tensor<%dx%dxf32>" % (R, O), "tensor<%dxi32>" % R %}
{% set vf, vi, vh = "vector<%dxf32>" % width, "vector<%dxi32>" % width, "vector<%dxi16>" % width %}
{% import "bf16_tile.mlir" as bf16 %}
{% from "bf16_tile.mlir" import round_rows %}
{% set weights, outputs = [], [] %}
{% for j in range(ot) %}
{% set _ = weights.append("%%w[%%e, %%o%d, %%k] : memref<%dx%dx%dxi16>" % (j, E, O, K)) %}
{% set _ = outputs.append("%%o%d" % j) %}
{% endfor %}
{% macro rows_body(n) %}
        scf.for %oi = %c0 to %c_otile step %c_ot {
          %o0 = arith.addi %o_base, %oi : index
{% for j in range(1, ot) %}
          %o{{j}} = arith.addi %o0, %c{{j}} : index
{% endfor %}
{{ bf16.tile(n, weights, outputs, "%r", "%x", "memref<%dx%dx%s>" % (R, K, xe), "%y", "memref<%dx%dxf32>" % (R, O), width, dot=dot) }}
        }
{% endmacro %}
stream.executable private @{{rows}}_dispatch {
  stream.executable.export public @{{rows}} workgroups() -> (index, index, index) {
    %x = arith.constant {{O // o_tile}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{rows}}(%x_b: !stream.binding, %w_b: !stream.binding, %ex_b: !stream.binding, %y_b: !stream.binding) {
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
{% for i in range(2, [n, ot] | max + 1) %}
        %c{{i}} = arith.constant {{i}} : index
{% endfor %}
        %c_ot = arith.constant {{ot}} : index
        %c_rows = arith.constant {{R}} : index
        %c_otile = arith.constant {{o_tile}} : index
        %c_k = arith.constant {{K}} : index
        %c_width = arith.constant {{width}} : index
        %c_step = arith.constant {{2 * width}} : index
        %c_last_expert = arith.constant {{E - 1}} : index
        %sixteen = arith.constant dense<16> : {{vi}}
        %zero = arith.constant dense<0.0> : {{vf}}
        %x = stream.binding.subspan %x_b[%c0] : !stream.binding -> memref<{{R}}x{{K}}x{{xe}}>
        %w = stream.binding.subspan %w_b[%c0] : !stream.binding -> memref<{{E}}x{{O}}x{{K}}xi16>
        %ex = stream.binding.subspan %ex_b[%c0] : !stream.binding -> memref<{{R}}xi32>
        %y = stream.binding.subspan %y_b[%c0] : !stream.binding -> memref<{{R}}x{{O}}xf32>
        %wg = stream.dispatch.workgroup.id[0] : index
        %o_base = arith.muli %wg, %c_otile : index
{{ runs.walk_rows(R, run_sizes, rows_body) }}
        return
    }
  }
}

util.func private @{{name}}(%x3: tensor<{{N}}x{{J}}x{{K}}xf32>, %weight: {{wt}}, %experts: tensor<{{N}}x{{J}}xi64>) -> tensor<{{N}}x{{J}}x{{O}}xf32> {
{% if dot == "bf16" %}
  %xf = tensor.collapse_shape %x3 [[0, 1], [2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into tensor<{{R}}x{{K}}xf32>
{{ round_rows("%xf", "%xr", R, K) }}
{% else %}
  %xr = tensor.collapse_shape %x3 [[0, 1], [2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into {{xt}}
{% endif %}
  %er = tensor.collapse_shape %experts [[0, 1]] : tensor<{{N}}x{{J}}xi64> into tensor<{{R}}xi64>
{{ runs.ids_i32("%er", "%ids", R) }}
  %bits = flow.tensor.bitcast %weight : {{wt}} -> tensor<{{E}}x{{O}}x{{K}}xi16>
  %yr = flow.dispatch @{{rows}}_dispatch::@{{rows}}(%xr, %bits, %ids) : ({{xt}}, tensor<{{E}}x{{O}}x{{K}}xi16>, {{ids_t}}) -> {{yt}}
  %y = tensor.expand_shape %yr [[0, 1], [2]] output_shape [{{N}}, {{J}}, {{O}}] : {{yt}} into tensor<{{N}}x{{J}}x{{O}}xf32>
  util.return %y : tensor<{{N}}x{{J}}x{{O}}xf32>
}

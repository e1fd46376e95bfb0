{#- The x86 dispatch of a bf16 linear layer on a block of rows (passes/weights.py `dense_block_function` says
    why): y[n, o] = sum_k widen(w[o, k]) * x[n, k]. A tile of nt rows x ot outputs keeps nt*ot vectors of
    `width` partial sums over the whole of K in registers, loading and widening each weight vector once
    for the nt rows and each row vector once for the ot outputs; the lanes are summed once at the end of
    K, inside the dispatch (the linalg kernel wrote the lanes out for a second dispatch to sum, 16 floats
    an output). Rows past the last whole tile of nt go one at a time.
    block:    {{name}}_block(x [N, K] f32, weight [O, K] bf16 bits) -> [N, O]
    wrapper:  {{name}}(x [N, 1, K], weight [1, O, K] bf16) -> [N, 1, O]
    pairs:    (E > 0: a decode step's routed pairs or per-head rows, each its own expert's decode row)
              {{name}}_block(x [R, K] f32, weight [E, O, K] bf16 bits, experts [R] i32) -> [R, O],
              workgroups R x O / o_tile, row r's through weight[experts[r]];
              wrapper {{name}}(x [1, R, K], weight [E, O, K] bf16, experts [1, R] i64) -> [1, R, O]
    params:   name, N, K, O, o_tile (outputs a workgroup), nt, ot, width, dot ("f32", or "bf16": the rows
              rounded to bf16 here and multiplied by `vdpbf16ps`, bf16_tile.mlir), chains (a decode row, N = 1:
              its sums over alternate vectors of K, `decode_row`), E and R (pairs; E = 0 otherwise) -#}
{% set block = name ~ "_block" %}
{% set n_full = N - N % nt %}
{% set xe = "i16" if dot == "bf16" else "f32" %}
{% set pairs = E > 0 %}
{% set rows_x = R if pairs else N %}
{% set xt, yt = "tensor<%dx%dx%s>" % (rows_x, K, xe), "tensor<%dx%dxf32>" % (rows_x, O) %}
{% set wt = "tensor<%dx%dx%dxi16>" % (E, O, K) if pairs else "tensor<%dx%dxi16>" % (O, K) %}
{% set w_mem = "memref<%dx%dx%dxi16>" % (E, O, K) if pairs else "memref<%dx%dxi16>" % (O, K) %}
{% set w_row = "%e, " if pairs else "" %}
{% set x_row = "%r" if pairs else "%c0" %}
{% set vf, vi, vh = "vector<%dxf32>" % width, "vector<%dxi32>" % width, "vector<%dxi16>" % width %}
{% import "bf16_tile.mlir" as bf16 %}
{% import "row_runs.mlir" as runs %}
{% from "bf16_tile.mlir" import round_rows %}
{% set weights, outputs = [], [] %}
{% for j in range(ot) %}
{% set _ = weights.append("%%w[%%o%d, %%k] : memref<%dx%dxi16>" % (j, O, K)) %}
{% set _ = outputs.append("%%o%d" % j) %}
{% endfor %}
{#- A decode row (N = 1): one output row at a time, `chains` sums over alternate vectors of K (with AVX2's
    8 lanes one sum's chain of adds held the weight's stream back) -#}
{% macro decode_row() %}
{% set sums = range(chains) | list %}
          %dsum:{{chains}} = scf.for %k = %c0 to %c_k step %c_chain iter_args({% for c in sums %}%s{{c}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({{ ([vf] * chains) | join(", ") }}) {
{% for c in sums %}
            %kc{{c}} = arith.addi %k, %c_off{{c}} : index
            %wb{{c}} = vector.load %w[{{w_row}}%o0, %kc{{c}}] : {{w_mem}}, {{vh}}
            %wi{{c}} = arith.extui %wb{{c}} : {{vh}} to {{vi}}
            %wh{{c}} = arith.shli %wi{{c}}, %sixteen : {{vi}}
            %wf{{c}} = arith.bitcast %wh{{c}} : {{vi}} to {{vf}}
            %xv{{c}} = vector.load %x[{{x_row}}, %kc{{c}}] : memref<{{rows_x}}x{{K}}xf32>, {{vf}}
            %t{{c}} = math.fma %wf{{c}}, %xv{{c}}, %s{{c}} : {{vf}}
{% endfor %}
            scf.yield {% for c in sums %}%t{{c}}{{ ", " if not loop.last }}{% endfor %} : {{ ([vf] * chains) | join(", ") }}
          }
{% set last = namespace(v="%dsum#0") %}
{% for c in sums[1:] %}
          %dadd{{c}} = arith.addf {{ last.v }}, %dsum#{{c}} : {{vf}}
{% set last.v = "%%dadd%d" % c %}
{% endfor %}
          %dot = vector.reduction <add>, {{ last.v }} : {{vf}} into f32
          memref.store %dot, %y[{{x_row}}, %o0] : memref<{{rows_x}}x{{O}}xf32>
{% endmacro %}
stream.executable private @{{block}}_dispatch {
  stream.executable.export public @{{block}} workgroups() -> (index, index, index) {
    %x = arith.constant {{(O // o_tile) * (R if pairs else 1)}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{block}}(%x_b: !stream.binding, %w_b: !stream.binding, {{ "%ex_b: !stream.binding, " if pairs }}%y_b: !stream.binding) {
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
{% for i in range(2, [nt, ot] | max) %}
        %c{{i}} = arith.constant {{i}} : index
{% endfor %}
        %c_nt = arith.constant {{nt}} : index
        %c_ot = arith.constant {{ot}} : index
        %c_n_full = arith.constant {{n_full}} : index
        %c_n = arith.constant {{N}} : index
        %c_otile = arith.constant {{o_tile}} : index
        %c_k = arith.constant {{K}} : index
        %c_width = arith.constant {{width}} : index
        %c_step = arith.constant {{2 * width}} : index
{% if N == 1 %}
        %c_chain = arith.constant {{chains * width}} : index
{% for c in range(chains) %}
        %c_off{{c}} = arith.constant {{c * width}} : index
{% endfor %}
{% endif %}
        %sixteen = arith.constant dense<16> : {{vi}}
        %zero = arith.constant dense<0.0> : {{vf}}
        %x = stream.binding.subspan %x_b[%c0] : !stream.binding -> memref<{{rows_x}}x{{K}}x{{xe}}>
        %w = stream.binding.subspan %w_b[%c0] : !stream.binding -> {{w_mem}}
        %y = stream.binding.subspan %y_b[%c0] : !stream.binding -> memref<{{rows_x}}x{{O}}xf32>
        %wg = stream.dispatch.workgroup.id[0] : index
{% if pairs %}
        // workgroup wg: row r = wg / (O / o_tile) through its expert, that row's tile wg % (O / o_tile)
        %ex = stream.binding.subspan %ex_b[%c0] : !stream.binding -> memref<{{R}}xi32>
        %c_tiles = arith.constant {{O // o_tile}} : index
        %c_last_expert = arith.constant {{E - 1}} : index
        %r = arith.divui %wg, %c_tiles : index
        %tile = arith.remui %wg, %c_tiles : index
        %id = memref.load %ex[%r] : memref<{{R}}xi32>
{{ runs.expert_of("%id", "%e") }}
        %o_base = arith.muli %tile, %c_otile : index
{% else %}
        %o_base = arith.muli %wg, %c_otile : index
{% endif %}
        // the ot outputs' weight rows (ot x K bf16) stay in L1 while every row of the block passes
        scf.for %oi = %c0 to %c_otile step %c_ot {
          %o0 = arith.addi %o_base, %oi : index
{% for j in range(1, ot) %}
          %o{{j}} = arith.addi %o0, %c{{j}} : index
{% endfor %}
{% if N == 1 %}
{{ decode_row() }}
{% elif n_full %}
          scf.for %n = %c0 to %c_n_full step %c_nt {
{{ bf16.tile(nt, weights, outputs, "%n", "%x", "memref<%dx%dx%s>" % (N, K, xe), "%y", "memref<%dx%dxf32>" % (N, O), width, "t", dot) }}
          }
{% endif %}
{% if n_full < N and N > 1 %}
          scf.for %n = %c_n_full to %c_n step %c1 {
{{ bf16.tile(1, weights, outputs, "%n", "%x", "memref<%dx%dx%s>" % (N, K, xe), "%y", "memref<%dx%dxf32>" % (N, O), width, "r", dot) }}
          }
{% endif %}
        }
        return
    }
  }
}

{% if pairs %}
util.func private @{{name}}(%x3: tensor<1x{{R}}x{{K}}xf32>, %weight: tensor<{{E}}x{{O}}x{{K}}xbf16>, %experts: tensor<1x{{R}}xi64>) -> tensor<1x{{R}}x{{O}}xf32> {
  %xr = tensor.collapse_shape %x3 [[0, 1], [2]] : tensor<1x{{R}}x{{K}}xf32> into {{xt}}
  %er = tensor.collapse_shape %experts [[0, 1]] : tensor<1x{{R}}xi64> into tensor<{{R}}xi64>
{{ runs.ids_i32("%er", "%ids", R) }}
  %bits = flow.tensor.bitcast %weight : tensor<{{E}}x{{O}}x{{K}}xbf16> -> {{wt}}
  %yr = flow.dispatch @{{block}}_dispatch::@{{block}}(%xr, %bits, %ids) : ({{xt}}, {{wt}}, tensor<{{R}}xi32>) -> {{yt}}
  %y = tensor.expand_shape %yr [[0, 1], [2]] output_shape [1, {{R}}, {{O}}] : {{yt}} into tensor<1x{{R}}x{{O}}xf32>
  util.return %y : tensor<1x{{R}}x{{O}}xf32>
}
{% else %}
util.func private @{{name}}(%x3: tensor<{{N}}x1x{{K}}xf32>, %weight: tensor<1x{{O}}x{{K}}xbf16>) -> tensor<{{N}}x1x{{O}}xf32> {
{% if dot == "bf16" %}
  %xf = tensor.collapse_shape %x3 [[0, 1], [2]] : tensor<{{N}}x1x{{K}}xf32> into tensor<{{N}}x{{K}}xf32>
{{ round_rows("%xf", "%xr", N, K) }}
{% else %}
  %xr = tensor.collapse_shape %x3 [[0, 1], [2]] : tensor<{{N}}x1x{{K}}xf32> into {{xt}}
{% endif %}
  %bits3 = flow.tensor.bitcast %weight : tensor<1x{{O}}x{{K}}xbf16> -> tensor<1x{{O}}x{{K}}xi16>
  %bits = tensor.collapse_shape %bits3 [[0, 1], [2]] : tensor<1x{{O}}x{{K}}xi16> into {{wt}}
  %yr = flow.dispatch @{{block}}_dispatch::@{{block}}(%xr, %bits) : ({{xt}}, {{wt}}) -> {{yt}}
  %y = tensor.expand_shape %yr [[0, 1], [2]] output_shape [{{N}}, 1, {{O}}] : {{yt}} into tensor<{{N}}x1x{{O}}xf32>
  util.return %y : tensor<{{N}}x1x{{O}}xf32>
}
{% endif %}

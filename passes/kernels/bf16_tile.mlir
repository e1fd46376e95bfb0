{#- The register tile of both x86 bf16 dispatches (dense_bf16_x86.mlir's routed pairs, dense_bf16_x86_block.mlir's
    block of rows): `rows` rows x len(weights) outputs keep `width`-lane partial sums over the whole of K in
    registers, each weight vector loaded and widened once for the rows and each row vector loaded once for
    the outputs; the lanes are summed once, at the end of K.
      weights[j]  where output j's weight vector at %k is: "%w[..., %k] : memref<...xi16>"
      outputs[j]  output j's index in y;   first: the tile's first row (an index value)
      x, xm / y, ym: the rows [*, K] f32 and the result [*, O] f32 memrefs and their types
    Needs %c0, %c_k, %c_width, %sixteen, %zero and %c<i> for 0 < i < rows; `tag` keeps the names of two
    tiles in one region apart.
    dot = "bf16" (kimi-compile --bf16-activations, AVX-512 with AVX512-BF16 only): the rows are bf16 bits
    (xm a memref of i16) and each step takes 2 x width values of K: one `vdpbf16ps` a row and output adds
    the products of bf16 pairs into the f32 sums (no widening; twice the multiplies an instruction), with
    %c_step = 2 x width instead of %c_width. -#}
{% macro tile(rows, weights, outputs, first, x, xm, y, ym, width, tag="", dot="f32") %}
{% set ot = weights | length %}
{% set vf, vi, vh = "vector<%dxf32>" % width, "vector<%dxi32>" % width, "vector<%dxi16>" % width %}
{% set accs = range(rows * ot) | list %}
          %acc{{tag}}:{{rows * ot}} = scf.for %k = %c0 to %c_k step {{ "%c_step" if dot == "bf16" else "%c_width" }} iter_args({% for a in accs %}%a{{a}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({% for a in accs %}{{vf}}{{ ", " if not loop.last }}{% endfor %}) {
{% if dot == "bf16" %}
{% set vp, vb = "vector<%dxi16>" % (2 * width), "vector<%dxbf16>" % (2 * width) %}
{% for j in range(ot) %}
            %wp{{j}} = vector.load {{ weights[j] }}, {{vp}}
            %wb{{j}} = arith.bitcast %wp{{j}} : {{vp}} to {{vb}}
{% endfor %}
{% for i in range(rows) %}
            %row{{i}} = arith.addi {{first}}, %c{{i}} : index
            %xp{{i}} = vector.load {{x}}[%row{{i}}, %k] : {{xm}}, {{vp}}
            %xv{{i}} = arith.bitcast %xp{{i}} : {{vp}} to {{vb}}
{% for j in range(ot) %}
            %b{{i * ot + j}} = llvm.call_intrinsic "llvm.x86.avx512bf16.dpbf16ps.512"(%a{{i * ot + j}}, %xv{{i}}, %wb{{j}}) : ({{vf}}, {{vb}}, {{vb}}) -> {{vf}}
{% endfor %}
{% endfor %}
{% else %}
{% for j in range(ot) %}
            // bf16 -> f32: the bits shifted into the high half (exact)
            %wb{{j}} = vector.load {{ weights[j] }}, {{vh}}
            %wi{{j}} = arith.extui %wb{{j}} : {{vh}} to {{vi}}
            %wh{{j}} = arith.shli %wi{{j}}, %sixteen : {{vi}}
            %wf{{j}} = arith.bitcast %wh{{j}} : {{vi}} to {{vf}}
{% endfor %}
{% for i in range(rows) %}
            %row{{i}} = arith.addi {{first}}, %c{{i}} : index
            %xv{{i}} = vector.load {{x}}[%row{{i}}, %k] : {{xm}}, {{vf}}
{% for j in range(ot) %}
            %b{{i * ot + j}} = math.fma %wf{{j}}, %xv{{i}}, %a{{i * ot + j}} : {{vf}}
{% endfor %}
{% endfor %}
{% endif %}
            scf.yield {% for a in accs %}%b{{a}}{{ ", " if not loop.last }}{% endfor %} : {% for a in accs %}{{vf}}{{ ", " if not loop.last }}{% endfor %}

          }
{% for i in range(rows) %}
          %yrow{{tag}}_{{i}} = arith.addi {{first}}, %c{{i}} : index
{% for j in range(ot) %}
          %sum{{tag}}_{{i}}_{{j}} = vector.reduction <add>, %acc{{tag}}#{{i * ot + j}} : {{vf}} into f32
          memref.store %sum{{tag}}_{{i}}_{{j}}, {{y}}[%yrow{{tag}}_{{i}}, {{ outputs[j] }}] : {{ym}}
{% endfor %}
{% endfor %}
{% endmacro %}

{#- The rows `src` (tensor<R x K x f32>) rounded to bf16 (to nearest even) as their bits, tensor<R x K x i16>, in
    `dst`: the input of a dot="bf16" tile, rounded once for every output. -#}
{% macro round_rows(src, dst, R, K) %}
  %{{dst[1:]}}_e = tensor.empty() : tensor<{{R}}x{{K}}xbf16>
  %{{dst[1:]}}_b = linalg.generic {indexing_maps = [affine_map<(r, k) -> (r, k)>, affine_map<(r, k) -> (r, k)>],
      iterator_types = ["parallel", "parallel"]}
      ins({{src}} : tensor<{{R}}x{{K}}xf32>) outs(%{{dst[1:]}}_e : tensor<{{R}}x{{K}}xbf16>) {
    ^bb0(%v: f32, %o: bf16):
      %t = arith.truncf %v : f32 to bf16
      linalg.yield %t : bf16
  } -> tensor<{{R}}x{{K}}xbf16>
  {{dst}} = flow.tensor.bitcast %{{dst[1:]}}_b : tensor<{{R}}x{{K}}xbf16> -> tensor<{{R}}x{{K}}xi16>
{% endmacro %}

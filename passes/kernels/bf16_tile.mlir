{#- The register tile of both x86 bf16 dispatches (dense_bf16_x86.mlir's routed pairs, dense_bf16_x86_block.mlir's
    block of rows): `rows` rows x len(weights) outputs keep `width`-lane partial sums over the whole of K in
    registers, each weight vector loaded and widened once for the rows and each row vector loaded once for
    the outputs; the lanes are summed once, at the end of K.
      weights[j]  where output j's weight vector at %k is: "%w[..., %k] : memref<...xi16>"
      outputs[j]  output j's index in y;   first: the tile's first row (an index value)
      x, xm / y, ym: the rows [*, K] f32 and the result [*, O] f32 memrefs and their types
    Needs %c0, %c_k, %c_width, %sixteen, %zero and %c<i> for 0 < i < rows; `tag` keeps the names of two
    tiles in one region apart. -#}
{% macro tile(rows, weights, outputs, first, x, xm, y, ym, width, tag="") %}
{% set ot = weights | length %}
{% set vf, vi, vh = "vector<%dxf32>" % width, "vector<%dxi32>" % width, "vector<%dxi16>" % width %}
{% set accs = range(rows * ot) | list %}
          %acc{{tag}}:{{rows * ot}} = scf.for %k = %c0 to %c_k step %c_width iter_args({% for a in accs %}%a{{a}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({% for a in accs %}{{vf}}{{ ", " if not loop.last }}{% endfor %}) {
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

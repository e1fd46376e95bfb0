{#- The x86 decode rows of an FP8 weight (fp8_e4m3_b128; passes/weights.py `fp8_decode_function` says why):
    y[r, o] = sum_k (e4m3(w[e, o, k]) * s[e, o / 128, k / 128]) * x[r, k], each row r streaming its expert's
    weight once, `width` codes a vector, `chains` sums over alternate vectors of K summed once at the end
    (in the dispatch). The weight is the reference's exactly: each code decoded through f16 (its 7 low bits
    placed in an f16 are the E4M3 value * 2^-8, vcvtph2ps widens them) times the block scale * 2^8, one
    rounding (passes/block_scaled.py `cpu_function` says why that equals v * s); only the f32 sum is
    reassociated. The scale is read once per 128 codes of K (K's last block may be partial).
    rows:     {{name}}_rows(x [R, K] f32, codes [E, O, K] i8, scales [E, OB, KB] f32[, experts [R] i32]) -> [R, O],
              workgroups R x O / o_tile, row r's through expert experts[r] (an id outside 0..E-1 reads the
              last expert), or expert 0 without experts (a linear layer's decode row: R = E = 1)
    wrapper:  {{name}}(x [1, R, K] f32, codes [E, O, K] ui8, scales[, experts [1, R] i64]) -> [1, R, O]
    params:   name, R, K, O, E, gathered, o_tile (outputs a workgroup), width, chains -#}
{% import "row_runs.mlir" as runs %}
{% set rows = name ~ "_rows" %}
{% set OB, KB, tail = (O + 127) // 128, (K + 127) // 128, K % 128 %}
{% set xt, yt = "tensor<%dx%dxf32>" % (R, K), "tensor<%dx%dxf32>" % (R, O) %}
{% set wt, st = "tensor<%dx%dx%dxi8>" % (E, O, K), "tensor<%dx%dx%dxf32>" % (E, OB, KB) %}
{% set w_mem, s_mem = "memref<%dx%dx%dxi8>" % (E, O, K), "memref<%dx%dx%dxf32>" % (E, OB, KB) %}
{% set vf, vh, vb, vm = "vector<%dxf32>" % width, "vector<%dxi16>" % width, "vector<%dxi8>" % width, "vector<%dxf16>" % width %}
{% set sums = range(chains) | list %}
{% set sum_types = ([vf] * chains) | join(", ") %}
{#- The sums `acc` (names, `chains` of them) carried over `length` codes of K from %kbase, each code times the
    block scale vector %sv; defines %<out>#0 .. #chains-1 -#}
{% macro block_sums(out, length, acc) %}
            %{{out}}_len = arith.constant {{length}} : index
            %{{out}}:{{chains}} = scf.for %kk = %c0 to %{{out}}_len step %c_chain iter_args({% for c in sums %}%s{{c}} = {{acc[c]}}{{ ", " if not loop.last }}{% endfor %}) -> ({{sum_types}}) {
              %k = arith.addi %kbase, %kk : index
{% for c in sums %}
              %kc{{c}} = arith.addi %k, %c_off{{c}} : index
              %code{{c}} = vector.load %w[%e, %o, %kc{{c}}] : {{w_mem}}, {{vb}}
              %wide{{c}} = arith.extui %code{{c}} : {{vb}} to {{vh}}
              // S.EEEE.MMM -> f16 S.0EEEE.MMM0000000, the value * 2^-8, subnormals included (f16 subnormals
              // widen exactly: DAZ acts on f32 inputs): the code in the high byte, shifted right one with its
              // sign, the sign's copy (bit 14) cleared
              %high{{c}} = arith.shli %wide{{c}}, %eight : {{vh}}
              %signed{{c}} = arith.shrsi %high{{c}}, %one : {{vh}}
              %h0{{c}} = arith.andi %signed{{c}}, %not_bit14 : {{vh}}
              // S.1111.111 is E4M3FN's NaN (as the reference decodes it); selected as i16 (as f16, LLVM
              // moved the select past the widening: twice the lanes' work)
              %low{{c}} = arith.andi %high{{c}}, %low7 : {{vh}}
              %isnan{{c}} = arith.cmpi eq, %low{{c}}, %low7 : {{vh}}
              %h{{c}} = arith.select %isnan{{c}}, %nan16, %h0{{c}} : vector<{{width}}xi1>, {{vh}}
              %hf{{c}} = arith.bitcast %h{{c}} : {{vh}} to {{vm}}
              %v{{c}} = arith.extf %hf{{c}} : {{vm}} to {{vf}}
              %wv{{c}} = arith.mulf %v{{c}}, %sv : {{vf}}
              %xv{{c}} = vector.load %x[%r, %kc{{c}}] : memref<{{R}}x{{K}}xf32>, {{vf}}
              %t{{c}} = math.fma %wv{{c}}, %xv{{c}}, %s{{c}} : {{vf}}
{% endfor %}
              scf.yield {% for c in sums %}%t{{c}}{{ ", " if not loop.last }}{% endfor %} : {{sum_types}}
            }
{% endmacro %}
{#- %sv: the scale of block (%e, %ob, `kb`) times 2^8, as a vector -#}
{% macro block_scale(kb) %}
            %s_one = memref.load %s[%e, %ob, {{kb}}] : {{s_mem}}
            %s_8 = arith.mulf %s_one, %c256 : f32
            %sv = vector.broadcast %s_8 : f32 to {{vf}}
{% endmacro %}
stream.executable private @{{rows}}_dispatch {
  stream.executable.export public @{{rows}} workgroups() -> (index, index, index) {
    %x = arith.constant {{(O // o_tile) * R}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{rows}}(%x_b: !stream.binding, %w_b: !stream.binding, %s_b: !stream.binding, {{ "%ex_b: !stream.binding, " if gathered }}%y_b: !stream.binding) {
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
        %c128 = arith.constant 128 : index
        %c_otile = arith.constant {{o_tile}} : index
        %c_tiles = arith.constant {{O // o_tile}} : index
        %c_full_blocks = arith.constant {{K // 128}} : index
        %c_chain = arith.constant {{chains * width}} : index
{% for c in sums %}
        %c_off{{c}} = arith.constant {{c * width}} : index
{% endfor %}
        %c256 = arith.constant 256.0 : f32
        %one = arith.constant dense<1> : {{vh}}
        %eight = arith.constant dense<8> : {{vh}}
        %not_bit14 = arith.constant dense<-16385> : {{vh}}    // 0xBFFF
        %low7 = arith.constant dense<32512> : {{vh}}          // 0x7F00: the code's low 7 bits, in the high byte
        %nan16 = arith.constant dense<32256> : {{vh}}         // 0x7E00: an f16 NaN
        %zero = arith.constant dense<0.0> : {{vf}}
        %x = stream.binding.subspan %x_b[%c0] : !stream.binding -> memref<{{R}}x{{K}}xf32>
        %w = stream.binding.subspan %w_b[%c0] : !stream.binding -> {{w_mem}}
        %s = stream.binding.subspan %s_b[%c0] : !stream.binding -> {{s_mem}}
        %y = stream.binding.subspan %y_b[%c0] : !stream.binding -> memref<{{R}}x{{O}}xf32>
        // workgroup wg: row r = wg / (O / o_tile), that row's tile wg % (O / o_tile)
        %wg = stream.dispatch.workgroup.id[0] : index
        %r = arith.divui %wg, %c_tiles : index
        %tile = arith.remui %wg, %c_tiles : index
{% if gathered %}
        %ex = stream.binding.subspan %ex_b[%c0] : !stream.binding -> memref<{{R}}xi32>
        %c_last_expert = arith.constant {{E - 1}} : index
        %id = memref.load %ex[%r] : memref<{{R}}xi32>
{{ runs.expert_of("%id", "%e") }}
{% else %}
        %e = arith.constant 0 : index
{% endif %}
        %o_base = arith.muli %tile, %c_otile : index
        scf.for %oi = %c0 to %c_otile step %c1 {
          %o = arith.addi %o_base, %oi : index
          %ob = arith.divui %o, %c128 : index
{% if K >= 128 %}
          %full:{{chains}} = scf.for %kb = %c0 to %c_full_blocks step %c1 iter_args({% for c in sums %}%b{{c}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({{sum_types}}) {
            %kbase = arith.muli %kb, %c128 : index
{{ block_scale("%kb") }}
{% set carried = [] %}
{% for c in sums %}{% set _ = carried.append("%%b%d" % c) %}{% endfor %}
{{ block_sums("blk", 128, carried) }}
            scf.yield {% for c in sums %}%blk#{{c}}{{ ", " if not loop.last }}{% endfor %} : {{sum_types}}
          }
{% set acc = [] %}
{% for c in sums %}{% set _ = acc.append("%%full#%d" % c) %}{% endfor %}
{% else %}
{% set acc = ["%zero"] * chains %}
{% endif %}
{% if tail %}
          %kbase = arith.constant {{K - tail}} : index
          %c_tail_block = arith.constant {{KB - 1}} : index
{{ block_scale("%c_tail_block") }}
{{ block_sums("tl", tail, acc) }}
{% set acc = [] %}
{% for c in sums %}{% set _ = acc.append("%%tl#%d" % c) %}{% endfor %}
{% endif %}
{% set last = namespace(v=acc[0]) %}
{% for c in sums[1:] %}
          %chain_add{{c}} = arith.addf {{ last.v }}, {{acc[c]}} : {{vf}}
{% set last.v = "%%chain_add%d" % c %}
{% endfor %}
          %dot = vector.reduction <add>, {{ last.v }} : {{vf}} into f32
          memref.store %dot, %y[%r, %o] : memref<{{R}}x{{O}}xf32>
        }
        return
    }
  }
}

util.func private @{{name}}(%x3: tensor<1x{{R}}x{{K}}xf32>, %codes: {{wt}}, %scales: {{st}}{{ (", %experts: tensor<1x" ~ R ~ "xi64>") if gathered }}) -> tensor<1x{{R}}x{{O}}xf32> {
  %xr = tensor.collapse_shape %x3 [[0, 1], [2]] : tensor<1x{{R}}x{{K}}xf32> into {{xt}}
{% if gathered %}
  %er = tensor.collapse_shape %experts [[0, 1]] : tensor<1x{{R}}xi64> into tensor<{{R}}xi64>
{{ runs.ids_i32("%er", "%ids", R) }}
  %yr = flow.dispatch @{{rows}}_dispatch::@{{rows}}(%xr, %codes, %scales, %ids) : ({{xt}}, {{wt}}, {{st}}, tensor<{{R}}xi32>) -> {{yt}}
{% else %}
  %yr = flow.dispatch @{{rows}}_dispatch::@{{rows}}(%xr, %codes, %scales) : ({{xt}}, {{wt}}, {{st}}) -> {{yt}}
{% endif %}
  %y = tensor.expand_shape %yr [[0, 1], [2]] output_shape [1, {{R}}, {{O}}] : {{yt}} into tensor<1x{{R}}x{{O}}xf32>
  util.return %y : tensor<1x{{R}}x{{O}}xf32>
}

{#- The x86 rows of an FP8 weight (fp8_e4m3_b128; passes/weights.py `fp8_rows_function` says why):
    y[r, o] = sum_k (e4m3(w[e, o, k]) * s[e, o / 128, k / 128]) * x[r, k], row r through expert e = experts[r]
    (an id outside 0..E-1 reads the last expert) or expert 0 (a linear layer: R = E = 1), `width` codes a
    vector, `chains` sums over alternate vectors of K summed once at the end (in the dispatch). The weight
    is the reference's exactly: each code decoded through f16 (its 7 low bits placed in an f16 are the
    E4M3 value * 2^-8, vcvtph2ps widens them) times the block scale * 2^8, one rounding
    (passes/block_scaled.py `cpu_function` says why that equals v * s); only the f32 sum is reassociated.
    The scale is read once per 128 codes of K (K's last block may be partial).
    Three forms:
      decode rows (run_sizes empty): workgroups R x O / o_tile, each one row's o_tile outputs, its
                  expert's codes streamed once (a decode step's k pairs, per-head rows, a linear layer)
      runs (run_sizes, e.g. [4, 2, 1]): workgroups O / o_tile, each walking all R rows (row_runs.mlir) in
                  runs of rows with one expert, each code decoded once for the run (a prefill's pairs,
                  sorted by expert)
      batched (the batched unit, x [M, E, K]: expert e on rows m x E + e, no experts operand): workgroups
                  O / o_tile, each expert's M rows in runs of run_sizes[0] (per-head projections of a block)
    rows:     {{name}}_rows(x [R, K] f32, codes [E, O, K] i8, scales [E, OB, KB] f32[, experts [R] i32]) -> [R, O]
    wrapper:  {{name}}(x [N, J, K] f32, codes [E, O, K] ui8, scales[, experts [N, J] i64]) -> [N, J, O], R = N x J
    params:   name, N, J, R, K, O, E, gathered, batched, o_tile (outputs a workgroup), width, chains, run_sizes -#}
{% import "row_runs.mlir" as runs %}
{% set rows = name ~ "_rows" %}
{% set OB, KB, tail = (O + 127) // 128, (K + 127) // 128, K % 128 %}
{% set xt, yt = "tensor<%dx%dxf32>" % (R, K), "tensor<%dx%dxf32>" % (R, O) %}
{% set wt, st = "tensor<%dx%dx%dxi8>" % (E, O, K), "tensor<%dx%dx%dxf32>" % (E, OB, KB) %}
{% set w_mem, s_mem = "memref<%dx%dx%dxi8>" % (E, O, K), "memref<%dx%dx%dxf32>" % (E, OB, KB) %}
{% set vf, vh, vb, vm = "vector<%dxf32>" % width, "vector<%dxi16>" % width, "vector<%dxi8>" % width, "vector<%dxf16>" % width %}
{% set sums = range(chains) | list %}
{#- The sums of a run of `m` rows (row i: %r_i, its sums i*chains .. i*chains + chains-1) carried in `acc`
    (names) over `length` codes of K from %kbase, each code decoded once for the m rows and times the block
    scale vector %sv; defines %<out>#0 .. #m*chains-1 -#}
{% macro block_sums(out, length, acc, m) %}
{% set n = m * chains %}
            %{{out}}_len = arith.constant {{length}} : index
            %{{out}}:{{n}} = scf.for %kk = %c0 to %{{out}}_len step %c_chain iter_args({% for a in range(n) %}%s{{a}} = {{acc[a]}}{{ ", " if not loop.last }}{% endfor %}) -> ({{ ([vf] * n) | join(", ") }}) {
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
{% for i in range(m) %}
              %xv{{i}}_{{c}} = vector.load %x[%r_{{i}}, %kc{{c}}] : memref<{{R}}x{{K}}xf32>, {{vf}}
              %t{{i}}_{{c}} = math.fma %wv{{c}}, %xv{{i}}_{{c}}, %s{{i * chains + c}} : {{vf}}
{% endfor %}
{% endfor %}
{% set results = [] %}
{% for i in range(m) %}{% for c in sums %}{% set _ = results.append("%%t%d_%d" % (i, c)) %}{% endfor %}{% endfor %}
              scf.yield {{ results | join(", ") }} : {{ ([vf] * n) | join(", ") }}
            }
{% endmacro %}
{#- %sv: the scale of block (%e, %ob, `kb`) times 2^8, as a vector -#}
{% macro block_scale(kb) %}
            %s_one = memref.load %s[%e, %ob, {{kb}}] : {{s_mem}}
            %s_8 = arith.mulf %s_one, %c256 : f32
            %sv = vector.broadcast %s_8 : f32 to {{vf}}
{% endmacro %}
{#- Rows %r .. %r + m - 1 through expert %e, the workgroup's outputs %o_base .. + o_tile - 1: y[r + i, o] -#}
{% macro outputs(m) %}
{% set n = m * chains %}
{% for i in range(m) %}
{% if batched %}
          %m_{{i}} = arith.addi %m, %c{{i}} : index
          %me_{{i}} = arith.muli %m_{{i}}, %c_experts : index
          %r_{{i}} = arith.addi %me_{{i}}, %e : index
{% else %}
          %r_{{i}} = arith.addi %r, %c{{i}} : index
{% endif %}
{% endfor %}
        scf.for %oi = %c0 to %c_otile step %c1 {
          %o = arith.addi %o_base, %oi : index
          %ob = arith.divui %o, %c128 : index
{% if K >= 128 %}
          %full:{{n}} = scf.for %kb = %c0 to %c_full_blocks step %c1 iter_args({% for a in range(n) %}%b{{a}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({{ ([vf] * n) | join(", ") }}) {
            %kbase = arith.muli %kb, %c128 : index
{{ block_scale("%kb") }}
{% set carried = [] %}
{% for a in range(n) %}{% set _ = carried.append("%%b%d" % a) %}{% endfor %}
{{ block_sums("blk", 128, carried, m) }}
            scf.yield {% for a in range(n) %}%blk#{{a}}{{ ", " if not loop.last }}{% endfor %} : {{ ([vf] * n) | join(", ") }}
          }
{% set acc = [] %}
{% for a in range(n) %}{% set _ = acc.append("%%full#%d" % a) %}{% endfor %}
{% else %}
{% set acc = ["%zero"] * n %}
{% endif %}
{% if tail %}
          %kbase = arith.constant {{K - tail}} : index
          %c_tail_block = arith.constant {{KB - 1}} : index
{{ block_scale("%c_tail_block") }}
{{ block_sums("tl", tail, acc, m) }}
{% set acc = [] %}
{% for a in range(n) %}{% set _ = acc.append("%%tl#%d" % a) %}{% endfor %}
{% endif %}
{% for i in range(m) %}
{% set last = namespace(v=acc[i * chains]) %}
{% for c in sums[1:] %}
          %chain_add{{i}}_{{c}} = arith.addf {{ last.v }}, {{acc[i * chains + c]}} : {{vf}}
{% set last.v = "%%chain_add%d_%d" % (i, c) %}
{% endfor %}
          %dot{{i}} = vector.reduction <add>, {{ last.v }} : {{vf}} into f32
          memref.store %dot{{i}}, %y[%r_{{i}}, %o] : memref<{{R}}x{{O}}xf32>
{% endfor %}
        }
{% endmacro %}
stream.executable private @{{rows}}_dispatch {
  stream.executable.export public @{{rows}} workgroups() -> (index, index, index) {
    %x = arith.constant {{(O // o_tile) * (1 if run_sizes else R)}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{rows}}(%x_b: !stream.binding, %w_b: !stream.binding, %s_b: !stream.binding, {{ "%ex_b: !stream.binding, " if gathered }}%y_b: !stream.binding) {
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
{% for i in range(2, (run_sizes or [1]) | max + 1) %}
        %c{{i}} = arith.constant {{i}} : index
{% endfor %}
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
        %wg = stream.dispatch.workgroup.id[0] : index
{% if gathered %}
        %ex = stream.binding.subspan %ex_b[%c0] : !stream.binding -> memref<{{R}}xi32>
        %c_last_expert = arith.constant {{E - 1}} : index
{% endif %}
{% if batched %}
        // workgroup wg: outputs wg * o_tile .. of every row; expert e's rows m x E + e in runs of {{run_sizes[0]}}
        %c_experts = arith.constant {{E}} : index
        %c_m = arith.constant {{R // E}} : index
        %c_m_full = arith.constant {{(R // E) - (R // E) % run_sizes[0]}} : index
        %c_run = arith.constant {{run_sizes[0]}} : index
        %o_base = arith.muli %wg, %c_otile : index
        scf.for %e = %c0 to %c_experts step %c1 {
          scf.for %m = %c0 to %c_m_full step %c_run {
{{ outputs(run_sizes[0]) }}
          }
          scf.for %m = %c_m_full to %c_m step %c1 {
{{ outputs(1) }}
          }
        }
{% elif run_sizes %}
        // workgroup wg: outputs wg * o_tile .. of every row, walked in runs of rows with one expert
        %c_rows = arith.constant {{R}} : index
        %o_base = arith.muli %wg, %c_otile : index
{{ runs.walk_rows(R, run_sizes, outputs) }}
{% else %}
        // workgroup wg: row r = wg / (O / o_tile), that row's tile wg % (O / o_tile)
        %r = arith.divui %wg, %c_tiles : index
        %tile = arith.remui %wg, %c_tiles : index
{% if gathered %}
        %id = memref.load %ex[%r] : memref<{{R}}xi32>
{{ runs.expert_of("%id", "%e") }}
{% else %}
        %e = arith.constant 0 : index
{% endif %}
        %o_base = arith.muli %tile, %c_otile : index
{{ outputs(1) }}
{% endif %}
        return
    }
  }
}

util.func private @{{name}}(%x3: tensor<{{N}}x{{J}}x{{K}}xf32>, %codes: {{wt}}, %scales: {{st}}{{ (", %experts: tensor<" ~ N ~ "x" ~ J ~ "xi64>") if gathered }}) -> tensor<{{N}}x{{J}}x{{O}}xf32> {
  %xr = tensor.collapse_shape %x3 [[0, 1], [2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into {{xt}}
{% if gathered %}
  %er = tensor.collapse_shape %experts [[0, 1]] : tensor<{{N}}x{{J}}xi64> into tensor<{{R}}xi64>
{{ runs.ids_i32("%er", "%ids", R) }}
  %yr = flow.dispatch @{{rows}}_dispatch::@{{rows}}(%xr, %codes, %scales, %ids) : ({{xt}}, {{wt}}, {{st}}, tensor<{{R}}xi32>) -> {{yt}}
{% else %}
  %yr = flow.dispatch @{{rows}}_dispatch::@{{rows}}(%xr, %codes, %scales) : ({{xt}}, {{wt}}, {{st}}) -> {{yt}}
{% endif %}
  %y = tensor.expand_shape %yr [[0, 1], [2]] output_shape [{{N}}, {{J}}, {{O}}] : {{yt}} into tensor<{{N}}x{{J}}x{{O}}xf32>
  util.return %y : tensor<{{N}}x{{J}}x{{O}}xf32>
}

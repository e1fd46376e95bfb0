{#- The row walk shared by the x86 routed-pairs dispatches (mxfp4_avx512.mlir, dense_bf16_x86.mlir; their and
    the decode pairs' (dense_bf16_x86_block.mlir) expert ids: `ids_i32`, `expert_of` below): rows r
    in order, each step the longest run of `sizes` (e.g. [4, 2, 1]) whose rows all have row r's expert, so a
    run shares each weight block's load and decode (the frontend sorts a prefill's pairs by expert; rows of
    different experts in any order are still correct, only slower). The caller's `body(m)` computes rows
    r .. r+m-1 through expert %e. Needs %c0, %c1, %c<i> for i < max(sizes), %c_rows (= R), %c_last_expert,
    %ex (the expert of each row, memref<R x i32>). -#}
{% macro run_of(R, sizes, body) %}
{% set m = sizes[0] %}
{% if sizes | length == 1 %}
{{ body(m) }}
            %r_next{{m}} = arith.addi %r, %c{{m}} : index
            scf.yield %r_next{{m}} : index
{% else %}
            %last{{m}} = arith.constant {{R - m}} : index
            %fits{{m}} = arith.cmpi ule, %r, %last{{m}} : index
            %run{{m}} = scf.if %fits{{m}} -> (i1) {
              %all{{m}}_0 = arith.constant true
{% for i in range(1, m) %}
              %rr{{m}}_{{i}} = arith.addi %r, %c{{i}} : index
              %id{{m}}_{{i}} = memref.load %ex[%rr{{m}}_{{i}}] : memref<{{R}}xi32>
              %eq{{m}}_{{i}} = arith.cmpi eq, %id{{m}}_{{i}}, %id0 : i32
              %all{{m}}_{{i}} = arith.andi %all{{m}}_{{i - 1}}, %eq{{m}}_{{i}} : i1
{% endfor %}
              scf.yield %all{{m}}_{{m - 1}} : i1
            } else {
              %no{{m}} = arith.constant false
              scf.yield %no{{m}} : i1
            }
            %next{{m}} = scf.if %run{{m}} -> (index) {
{{ body(m) }}
              %r_next{{m}} = arith.addi %r, %c{{m}} : index
              scf.yield %r_next{{m}} : index
            } else {
{{ run_of(R, sizes[1:], body) }}
            }
            scf.yield %next{{m}} : index
{% endif %}
{% endmacro %}

{% macro walk_rows(R, sizes, body) %}
        %end = scf.while (%r = %c0) : (index) -> index {
          %more = arith.cmpi ult, %r, %c_rows : index
          scf.condition(%more) %r : index
        } do {
        ^bb0(%r: index):
          %id0 = memref.load %ex[%r] : memref<{{R}}xi32>
{{ expert_of("%id0", "%e") }}
{{ run_of(R, sizes, body) }}
        }
{% endmacro %}

{#- The row `prefetch` rows ahead of (%e, %o) in a workgroup's walk: the next output of this run's expert,
    past the tile's last output the first ones of the next run's expert (the run of n rows at %r is
    followed by the one at %r + n). A tile's rows of one expert are too short a stream for the hardware
    prefetcher; the MXFP4 dispatch prefetches that row while computing this one (the bf16 routed pairs
    measured no gain from it). `next_run_expert` (once a run, before its loop over outputs) defines
    %e_next from walk_rows' %r, %ex, %c_last_expert and %c<n>, and %c_last_row (R - 1); `ahead` (each
    output) defines %e_pf, %o_pf from %e, %e_next, %oi, %o_base, %c_otile, %c_pf (the distance) and
    %c_last_o (O - 1). -#}
{% macro next_run_expert(R, n) %}
        %r_after0 = arith.addi %r, %c{{n}} : index
        %r_after = arith.minui %r_after0, %c_last_row : index
        %id_after = memref.load %ex[%r_after] : memref<{{R}}xi32>
{{ expert_of("%id_after", "%e_next") }}
{% endmacro %}

{% macro ahead() %}
          %pf_i = arith.addi %oi, %c_pf : index
          %pf_wrap = arith.cmpi uge, %pf_i, %c_otile : index
          %pf_i_next = arith.subi %pf_i, %c_otile : index
          %pf_oi = arith.select %pf_wrap, %pf_i_next, %pf_i : index
          %o_pf0 = arith.addi %o_base, %pf_oi : index
          %o_pf = arith.minui %o_pf0, %c_last_o : index
          %e_pf = arith.select %pf_wrap, %e_next, %e : index
{% endmacro %}

{#- %e (index) from an expert id (i32) of the dispatch's %ex: an id outside 0..E-1 (never from the router)
    reads the last expert, not out of bounds. Needs %c_last_expert (E - 1). -#}
{% macro expert_of(id, e) %}
          {{e}}_id = arith.index_castui {{id}} : i32 to index
          {{e}} = arith.minui {{e}}_id, %c_last_expert : index
{% endmacro %}

{#- In the wrapper: `dst` (tensor<R x i32>) the expert ids `src` (tensor<R x i64>) as i32, the routed-pairs
    dispatches' interface (it must not change under --iree-input-demote-i64-to-i32). -#}
{% macro ids_i32(src, dst, R) %}
  {{dst}}0 = tensor.empty() : tensor<{{R}}xi32>
  {{dst}} = linalg.generic {indexing_maps = [affine_map<(r) -> (r)>, affine_map<(r) -> (r)>], iterator_types = ["parallel"]}
      ins({{src}} : tensor<{{R}}xi64>) outs({{dst}}0 : tensor<{{R}}xi32>) {
    ^bb0(%e64: i64, %o: i32):
      %e32 = arith.trunci %e64 : i64 to i32
      linalg.yield %e32 : i32
  } -> tensor<{{R}}xi32>
{% endmacro %}

{#- The shuffle tree of the x86 decode tiles (passes/sparse_attention.py `shuffle_tree`): `width` vectors
    %<src>#0 .. %<src>#(width-1) summed so that lane i of the result is the sum of the lanes of %<src>#i;
    stage j pairs its vectors, taking the first and second half of every lane group of both. The result
    is %<out><stages - 1>_0 (`lane_sums_result`). -#}
{% macro lane_sums(src, out, width, tree, vf) %}
{% set ns = namespace(vals=[]) %}
{% for i in range(width) %}{% set ns.vals = ns.vals + ["%" ~ src ~ "#" ~ i] %}{% endfor %}
{% for lo, hi in tree %}
{% set stage = loop.index0 %}
{% set next = namespace(vals=[]) %}
{% for m in range(ns.vals | length // 2) %}
%{{out}}{{stage}}_{{m}}_lo = vector.shuffle {{ ns.vals[2 * m] }}, {{ ns.vals[2 * m + 1] }} [{{ lo | join(", ") }}] : {{vf}}, {{vf}}
%{{out}}{{stage}}_{{m}}_hi = vector.shuffle {{ ns.vals[2 * m] }}, {{ ns.vals[2 * m + 1] }} [{{ hi | join(", ") }}] : {{vf}}, {{vf}}
%{{out}}{{stage}}_{{m}} = arith.addf %{{out}}{{stage}}_{{m}}_lo, %{{out}}{{stage}}_{{m}}_hi : {{vf}}
{% set next.vals = next.vals + ["%%%s%d_%d" % (out, stage, m)] %}
{% endfor %}
{% set ns.vals = next.vals %}
{% endfor %}
{% endmacro %}

{% macro lane_sums_result(out, tree) %}%{{out}}{{ tree | length - 1 }}_0{% endmacro %}

"""kimi_iree.driver: `kimi-compile`, the one place that strings frontend -> passes -> targets together."""

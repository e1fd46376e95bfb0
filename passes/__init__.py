"""kimi_iree.passes (see ../shared/design/ARCHITECTURE.md)."""

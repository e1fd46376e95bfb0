"""kimi_iree.targets (see ../shared/design/ARCHITECTURE.md)."""

"""kimi_iree.runtime (see ../shared/design/ARCHITECTURE.md)."""

"""kimi_iree.frontend: the PyTorch model definition, checkpoint reading, conversion and export to MLIR.

    from kimi_iree.frontend import load_model
    model = load_model("path/to/checkpoint")
    logits = model(input_ids)                      # [B, T, vocab]
"""

from .checkpoint import CheckpointReader
from .config import ModelConfig, load_config, parse_config
from .errors import CheckpointError, ConfigError, FrontendError
from .model import KimiModel
from .plan import load_model

__all__ = ["CheckpointError", "CheckpointReader", "ConfigError", "FrontendError", "KimiModel", "ModelConfig",
           "load_config", "load_model", "parse_config"]

"""Configuration: typed schema (``schema``) and loading from YAML/presets/overrides (``load``).

Imports no torch, so the CLI's config commands stay fast.
"""

from moetrain.config.load import config_docs, dump_config, list_presets, load_config
from moetrain.config.schema import Config
from moetrain.errors import ConfigError

__all__ = ["Config", "ConfigError", "config_docs", "dump_config", "list_presets", "load_config"]

"""The configuration: frozen pydantic models validated once at load, errors that name the YAML key,
and the JSON Schema.
"""

from proxy.config.models import (
    MAX_N_CEILING,
    Clients,
    Config,
    ConfigError,
    Listen,
    Upstream,
    config_schema,
    load_config,
    single_upstream_config,
)

__all__ = [
    "MAX_N_CEILING",
    "Clients",
    "Config",
    "ConfigError",
    "Listen",
    "Upstream",
    "config_schema",
    "load_config",
    "single_upstream_config",
]

"""Settings, declared once, and everything derived from them (docs/CONFIG.md).

- ``settings``: the ``Settings`` table (with ``PolicyConfig`` and ``CouncilSettings``): each
  field's help, flag and checks in its ``setting(...)`` metadata; ``SETTINGS`` lists them;
- ``sections``: the structured ``--config`` sections (``[[backends]]``, ``[aliases]``,
  ``[limits]``) registered in ``SECTIONS``, and reading the TOML file;
- ``limits``: the ``[limits]`` section's values and their parser (admission/ reads them);
- ``embedded``: the embedded simulator's settings (``--sim``, ``THUNDERPROXY_SIM_*``);
- ``loading``: ``load_settings``, defaults < config file < environment variables < flags;
- ``help``: the click options, ``serve --help``'s sections and the README's table.

Import from here: ``from thunderproxy.config import Settings, load_settings``.
"""

from __future__ import annotations

from ..where import Where
from .embedded import SIM_ENV_PREFIX, sim_environment, sim_overrides
from .help import HELP_SECTIONS, SettingsCommand, settings_options, settings_table
from .loading import given_values, load_settings
from .sections import SECTIONS, ConfigFile, SectionParser, read_config_file, section
from .settings import (
    BYTES,
    ENV_PREFIX,
    RECOGNITION_DEFAULT,
    RECOGNITION_SOURCES,
    SECONDS,
    SETTINGS,
    SETTINGS_BY_NAME,
    STRUCTURED,
    BackendSpec,
    Check,
    CouncilSettings,
    FrozenMap,
    PolicyConfig,
    Setting,
    Settings,
    recognition_sources,
    setting,
)

__all__ = [
    "BYTES",
    "BackendSpec",
    "Check",
    "ConfigFile",
    "CouncilSettings",
    "ENV_PREFIX",
    "FrozenMap",
    "HELP_SECTIONS",
    "PolicyConfig",
    "RECOGNITION_DEFAULT",
    "RECOGNITION_SOURCES",
    "SECONDS",
    "SECTIONS",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "SIM_ENV_PREFIX",
    "STRUCTURED",
    "SectionParser",
    "Setting",
    "Settings",
    "SettingsCommand",
    "Where",
    "given_values",
    "load_settings",
    "read_config_file",
    "recognition_sources",
    "section",
    "setting",
    "settings_options",
    "settings_table",
    "sim_environment",
    "sim_overrides",
]

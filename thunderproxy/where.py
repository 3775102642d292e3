"""Where in a config file a value sits: the location every section parser reports problems at.

It lives apart from config/ so that a section's parser (``[limits]`` in config/limits.py) can
take it without importing the settings table that registers the parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Where:
    """Where in a config file a value sits, for error messages: ``file: backends[1].url``."""

    file: str
    key: str

    def at(self, index: int) -> Where:
        return Where(self.file, f"{self.key}[{index}]")

    def dot(self, name: str) -> Where:
        return Where(self.file, f"{self.key}.{name}")

    def error(self, problem: str, remedy: str) -> ConfigError:
        end = "" if remedy.endswith("?") else "."
        return ConfigError(f"{self.file}: {self.key}: {problem}; {remedy}{end}")

"""Where the built-in hardware presets are (TOML files shipped with the package) and what they are called, without
reading them: the command line's flags and ``--help`` list the names without importing torch."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

CPU_EMULATED = "cpu-emulated"
"""The profile of this machine's CPU with an emulated link (measured, not a file)."""


def preset_files() -> dict[str, Path]:
    """Each preset's TOML file, by name."""
    folder = resources.files("hyperoffload.hardware") / "presets"
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".toml")}


PRESET_NAMES: tuple[str, ...] = (*sorted(preset_files()), CPU_EMULATED)
"""Every profile name ``get_hardware`` takes, the measured ``cpu-emulated`` last."""

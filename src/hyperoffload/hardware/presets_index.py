"""Look up hardware profiles by name: the TOML presets shipped with the package, and ``cpu-emulated``."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from hyperoffload.hardware.cpu import cpu_emulated, load_or_measure
from hyperoffload.hardware.preset_files import CPU_EMULATED, PRESET_NAMES, preset_files
from hyperoffload.hardware.profile import Hardware, HardwareError, load_hardware_file


@lru_cache(maxsize=None)
def _load_preset(name: str) -> Hardware:
    return load_hardware_file(preset_files()[name])


def get_hardware(name: str, *, cpu_cache: Path | None = None) -> Hardware:
    """The profile called ``name`` (a preset, or ``cpu-emulated``), or one read from a ``.toml`` file path.

    ``cpu-emulated`` runs the CPU calibration unless ``cpu_cache`` holds a matching result.
    """
    if name.endswith(".toml"):
        return load_hardware_file(name)
    if name == CPU_EMULATED:
        return cpu_emulated(load_or_measure(cpu_cache))
    if name not in PRESET_NAMES:
        raise HardwareError(f"unknown hardware {name!r}; choose one of: {', '.join(PRESET_NAMES)}, "
                            f"or give a path to your own .toml profile")
    return _load_preset(name)


def as_hardware(hardware: Hardware | str) -> Hardware:
    """``hardware`` itself, or the profile it names (``get_hardware``): what every public function that takes a
    profile accepts."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str):
        return get_hardware(hardware)
    raise HardwareError(f"expected a Hardware profile or its name (such as 'h100-sxm'), got {type(hardware).__name__}")


def list_hardware() -> list[Hardware]:
    """Every TOML preset (``cpu-emulated`` is listed separately because it needs a calibration)."""
    return [_load_preset(name) for name in PRESET_NAMES if name != CPU_EMULATED]

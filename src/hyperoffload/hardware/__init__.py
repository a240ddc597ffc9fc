"""Hardware profiles: built-in presets (data with sources), user TOML files, the calibrated CPU."""

from hyperoffload.lazy import lazy_package

_WHERE = {
    "PRESET_NAMES": "hyperoffload.hardware.preset_files",
    "as_hardware": "hyperoffload.hardware.presets_index",
    "get_hardware": "hyperoffload.hardware.presets_index",
    "list_hardware": "hyperoffload.hardware.presets_index",
    "Hardware": "hyperoffload.hardware.profile",
    "HardwareError": "hyperoffload.hardware.profile",
    "hardware_from_dict": "hyperoffload.hardware.profile",
    "load_hardware_file": "hyperoffload.hardware.profile",
}
"""Where each attribute of the package lives (imported on first use)."""

lazy_package(__name__, _WHERE)

__all__ = ["PRESET_NAMES", "Hardware", "HardwareError", "as_hardware", "get_hardware", "hardware_from_dict", "list_hardware",
           "load_hardware_file"]

"""Hardware profiles: built-in presets (data with sources), user TOML files, the calibrated CPU."""

from hyperoffload.hardware.presets_index import PRESET_NAMES, as_hardware, get_hardware, list_hardware
from hyperoffload.hardware.profile import Hardware, HardwareError, hardware_from_dict, load_hardware_file

__all__ = ["PRESET_NAMES", "Hardware", "HardwareError", "as_hardware", "get_hardware", "hardware_from_dict", "list_hardware",
           "load_hardware_file"]

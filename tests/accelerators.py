"""Which accelerator this machine has, found before JAX starts a backend (tests/conftest.py then starts it
beside the CPU, which stays the default backend for the unit tests)."""


def accelerator_platform() -> str | None:
    """ "tpu" or "cuda" where JAX's own hardware checks see such a device, else None."""
    try:
        from jax._src import hardware_utils

        if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
            return "tpu"
        if hardware_utils.has_visible_nvidia_gpu():
            return "cuda"
    except (ImportError, AttributeError):  # a JAX without these checks: the unit tests on the CPU only
        pass
    return None

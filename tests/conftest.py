import os

from hypothesis import HealthCheck, settings

# Deterministic, CPU-friendly property tests: the same examples on every machine and in CI.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Without a GPU, Triton's interpreter runs the fused kernels on the CPU (read when triton is first imported).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

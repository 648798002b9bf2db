"""Options for every onnxruntime session the package makes: one process-wide intra-op thread pool.

With a thread pool per session, the idle threads of one session keep spinning while another runs,
so the drafter's and the predictor's pools competed with the target's for the cores: measured on
2 cores, a target forward took up to twice as long beside a drafter session as alone. All sessions
share one pool instead. onnxruntime requires every session of the process to agree once a global
pool exists, so every session here goes through `session_options`.
"""

from __future__ import annotations

import functools


def session_options(threads: int | None = None):
    """`SessionOptions` on the shared pool, warnings muted. `threads` sizes the pool the first time
    (None: all cores); later calls keep the first size."""
    import onnxruntime as ort

    _share_thread_pool(threads)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.use_per_session_threads = False
    return options


@functools.cache
def _share_thread_pool(threads: int | None) -> None:
    from onnxruntime.capi import _pybind_state

    try:
        _pybind_state.set_global_thread_pool_sizes(threads or 0, 1)
    except Exception as exc:  # onnxruntime's own Fail type: the pool exists (another size asked for first)
        if "already been created" not in str(exc):
            raise

"""quiet_upstream drops only the listed messages, only inside its block, and leaves nothing behind."""

import logging
import warnings

from grpo_accel.core.upstream_noise import quiet_upstream


def test_only_the_listed_messages_inside_the_block(caplog):
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    msg = "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'"
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_upstream():
            bnb.warning(msg)
            bnb.warning("another bitsandbytes line")  # not listed: shows
            logging.getLogger("bitsandbytes.other").warning(msg)  # another logger: shows
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed", FutureWarning, stacklevel=1)
            warnings.warn("`is_gradient_checkpointing` is deprecated", UserWarning, stacklevel=1)  # other category
        bnb.warning(msg)  # after the block: shows
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed", FutureWarning, stacklevel=1)
    records = [(r.name, r.getMessage()) for r in caplog.records]
    assert records == [("bitsandbytes.backends.cpu.ops", "another bitsandbytes line"), ("bitsandbytes.other", msg),
                       ("bitsandbytes.backends.cpu.ops", msg)]
    assert [type(w.message) for w in seen] == [UserWarning, FutureWarning]
    assert not bnb.filters

"""What the `sglang` serve backend asks of SGLang for `logprobs`, against SGLang 0.5.23's own code: the
`/generate` fields it sends, the `meta_info` keys it reads (and that they stream cumulatively, like
`output_ids`), the switch to the raw distribution, and the DFlash worker (which DRELAY's worker
subclasses) computing them from its verify logits."""

from __future__ import annotations

import inspect

import pytest

from deploy.serve.backends.base import GenRequest
from deploy.serve.backends.sglang import request_body, server_env

pytestmark = pytest.mark.sglang_cpu


def test_generate_accepts_the_logprob_fields_we_send():
    from sglang.srt.managers.io_struct import GenerateReqInput

    body = request_body(GenRequest(prompt_ids=[1, 2, 3], logprobs=4))
    req = GenerateReqInput(**{k: v for k, v in body.items()})
    req.normalize_batch_and_arguments()
    assert req.return_logprob is True and req.top_logprobs_num == 4 and req.logprob_start_len == -1


def test_meta_info_keys_and_streaming_are_what_we_parse():
    from sglang.srt.managers import tokenizer_manager

    source = inspect.getsource(tokenizer_manager)
    for key in ('meta_info["output_token_logprobs"]', 'meta_info["output_top_logprobs"]'):
        assert key in source
    # incremental streaming is opt-in: by default a stream's logprob lists are cumulative, like output_ids
    assert "output_token_logprobs" in tokenizer_manager._INCREMENTAL_STREAMING_META_INFO_KEYS
    assert "incremental = is_stream and self.incremental_streaming_output" in source


def test_raw_logprobs_switch_and_the_speculative_worker_computes_them():
    from sglang.srt.environ import envs
    from sglang.srt.layers import logprob_processor
    from sglang.srt.speculative import dflash_worker_v2

    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in server_env({}, gpu_ids=["0"])
    assert envs.SGLANG_RETURN_ORIGINAL_LOGPROB is not None
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in inspect.getsource(logprob_processor.compute_spec_logprobs)
    assert "compute_spec_logprobs(" in inspect.getsource(dflash_worker_v2.DFlashWorkerV2)

"""The draft-model class SGLang's registry resolves for an export (`architectures =
["DRelayDraftModel"]`; the registry keys classes by `__name__`, hence the name).

It is runner.py's `DRelayRunnerModel` with one RadixAttention per layer attached on construction,
which is the one step that needs sglang. The plain-PyTorch `deploy.sglang.model.DRelayDraftModel`
(same name, bound to our own target for the CPU engine and tests) is a different class.
"""

from deploy.sglang.runner import DRelayRunnerModel


class DRelayDraftModel(DRelayRunnerModel):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.attach_radix_attention()


EntryClass = DRelayDraftModel

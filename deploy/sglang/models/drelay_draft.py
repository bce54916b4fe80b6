"""`DRelayDraftModel` for SGLang's external model registry (see deploy/sglang/model.py)."""

from deploy.sglang.model import DRelayDraftModel

EntryClass = DRelayDraftModel

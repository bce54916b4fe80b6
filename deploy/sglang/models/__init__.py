"""SGLANG_EXTERNAL_MODEL_PACKAGE=deploy.sglang.models: every module here exposes an `EntryClass`
whose class name matches an exported checkpoint's `architectures`."""

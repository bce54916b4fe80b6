"""DRelay inside SGLang: checkpoint export (export.py), the draft-model class SGLang loads
(model.py), the per-request verified-feature history (history.py) and the plugin (plugin.py).
Importing this package never imports sglang."""

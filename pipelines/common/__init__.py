"""What every part of the platform shares.

    paths.py     REPO_ROOT, repo_path, bundled checkpoints, NAME_PATTERN (run and variant labels)
    outputs.py   the one output root (config field > $DRELAY_OUTPUT_ROOT > <repo>/outputs), URIs untouched
    run_tags.py  the MLflow tag vocabulary (drelay.kind/target/method/git_commit/hardware)
    provenance.py  which MLflow run made a checkpoint (provenance.json)
    registry.py  MLflow model registry: register a checkpoint, resolve models:/<name>@<alias>
    methods.py   the method spec: 'ar' or a registered selector plus its checkpoint, resolved once
    chat.py      chat messages → prompt token ids (the one place a chat template is applied)
    costs.py     the measured round-cost curve (cost-aware verification length), cached per machine
    tracking.py  MLflow: where runs go, runs that always end, stale-run cleanup
    store.py     one JSON file per key, written atomically (evaluation cells, replay cells)
    yaml_file.py the one reader of user YAML documents (run, sweep, serve configs; runtime envs)
    config_base.py  StrictConfig (extra keys forbidden, frozen), the base of every config schema, and
                 the one formatter of its errors (`field.path: message`)
    signals.py   SIGTERM as SystemExit while a tracked job runs

May import: drelay_model and third-party libraries. Never another pipelines package or deploy.
"""

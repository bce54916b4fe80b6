"""Data: the evaluation prompt sets, training corpora and greedy regeneration of training answers.

    eval_sets.py    the eight evaluation benchmarks' prompts behind one loader (data/benchmarks/)
    corpora.py      training conversations (data/train/, ShareGPT files)
    regenerate.py   `drelay data regenerate`: the target's own greedy answers, resumable
    stored_jsonl.py JSONL files on disk: plain while appended to, xz-compressed once finished

May import: pipelines.common, drelay_model. Never eval, train, study, cli or deploy.
"""

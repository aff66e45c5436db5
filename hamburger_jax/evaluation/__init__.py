"""Evaluation: tasks and scorers (reasoning-gym exact match, HumanEval pass@1, MT-Bench ROUGE-L),
the OS sandbox that runs model-written code, batched generation and its scoring, bootstrap
intervals, the teacher-forced evaluator that training and `infer.eval` share, and results.md."""

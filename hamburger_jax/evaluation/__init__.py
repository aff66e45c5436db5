"""Evaluation tasks and scorers (reasoning-gym exact match, HumanEval pass@1, MT-Bench ROUGE-L)
and the OS sandbox that runs model-written code. No model code here."""

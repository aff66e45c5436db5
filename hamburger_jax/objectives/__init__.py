"""The training objectives: the paper's loss (losses.py), the distill recipe's (distillation.py)
and its teacher computed in the step (online_teacher.py)."""

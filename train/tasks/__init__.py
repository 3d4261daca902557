"""The tasks: what a run trains (language modelling, classification, preference pairs, GRPO and
RLOO, reward models, distillation), each with its settings, data, steps and evaluation."""

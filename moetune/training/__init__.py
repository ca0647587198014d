"""Training-loop building blocks that sit between the model and the recipe."""

from moetune.training.cuda_graph import CUDAGraphTrainStep, set_learning_rate

__all__ = ["CUDAGraphTrainStep", "set_learning_rate"]

"""A training library's own loop on Forgeline, one callback away (level 2 of "your own code").

A script that trains with a library's trainer runs as a script that keeps its own checkpoints
(`train.checkpoints = "folder"`): it saves into its output folder, which the node agent commits
and restores. The callback adds what the library cannot know of: its metrics go to the run's
heartbeats and MLflow (`forgeline.report`), a preemption or a drain (SIGTERM from the node
agent) becomes a save and a clean stop, and a restarted gang resumes from the last commit.

    forgeline.integrations.transformers   # a TrainerCallback for Hugging Face Trainer

Each module imports its library at the top: import the one your script uses, in an
environment that has the library (your code folder's requirements.txt).
"""

"""The models-from-code entry of a registered version (`python_model=` this file's path).

MLflow runs this file when it loads the version, after putting the version's code/ folder first
on sys.path, so the imports below find the copies the version carries (trainer/serving.py's
SHIPPED_MODULES). Nothing is unpickled: the model is built from code, then from safetensors.
Not imported by Forgeline itself; `set_model` is how a models-from-code file hands MLflow its model.
"""

from mlflow.models import set_model

from trainer.serving import GPTTextModel

set_model(GPTTextModel())

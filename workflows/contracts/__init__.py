"""What crosses a boundary, typed: the run spec a user submits (`spec`), the models between
workflows, activities and the CLI (`models`), the cluster's state as the scheduler sees it
(`cluster_models`), the HTTP API's requests and answers (`api_models`), and the well-known
workflow ids and task queues (`names`). Old fields keep their defaults so that old histories
and old clients still load.
"""

"""Running the platform on a shared cluster: where things are written (`paths`), job submission
(`submit`, `jobs`), the platform/cluster spec schemas (`specs`) and the MLflow model registry
(`registry`)."""

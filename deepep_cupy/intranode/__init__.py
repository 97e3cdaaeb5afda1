"""The intranode path: dispatch and combine over NVLink between the GPUs of one node."""

"""A minimal stand-in for Triton's `triton_python_backend_utils`, for tests only.

Implements just what trtllm_moespec.runtime.triton_model touches: Tensor,
InferenceRequest-like objects, get_input_tensor_by_name, InferenceResponse,
TritonError, TritonModelException and the final-response flag.
"""

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonModelException(Exception):
    pass


class TritonError:
    def __init__(self, message):
        self._message = message

    def message(self):
        return self._message


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class ResponseSender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        self.sent.append((response, flags))


class InferenceRequest:
    def __init__(self, inputs):
        self.inputs = {name: Tensor(name, value) for name, value in inputs.items()}
        self.sender = ResponseSender()

    def get_response_sender(self):
        return self.sender


class InferenceResponse:
    def __init__(self, output_tensors, error=None):
        self.output_tensors, self.error = list(output_tensors), error

    def tensor(self, name):
        return next(t.as_numpy() for t in self.output_tensors if t.name() == name)


def get_input_tensor_by_name(request, name):
    return request.inputs.get(name)


class AutoCompleteConfig:
    def __init__(self):
        self.policy, self.max_batch_size = None, None

    def set_model_transaction_policy(self, policy):
        self.policy = policy

    def set_max_batch_size(self, n):
        self.max_batch_size = n

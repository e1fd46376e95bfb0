"""The name tables' byte-preserving transforms: each one's shape function is what its tensor function
does (the converter plans with the first and writes with the second), and every rule's transforms are
among them."""

import pytest
import torch

from kimi_iree.frontend import names


TRANSFORMS = [names.RESHAPE, names.EVEN_ROWS, names.ODD_ROWS, names.BLOCKS]


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(6, 4), (7, 5), (3, 9, 2, 16), (4, 1, 16)])
def test_shape_function_is_what_the_tensor_function_does(transform, shape):
    tensor = torch.arange(torch.Size(shape).numel()).reshape(shape)
    assert tuple(transform.tensor(tensor).shape) == tuple(transform.shape(shape))


def test_transforms_keep_the_bytes():
    """Row slices and block reshapes move no byte within a row: gpt-oss' gate rows are the even ones."""
    blocks = torch.arange(2 * 4 * 3 * 16).reshape(2, 4, 3, 16)
    assert torch.equal(names.BLOCKS.tensor(blocks).flatten(), blocks.flatten())
    rows = torch.arange(10).reshape(5, 2)
    assert names.EVEN_ROWS.tensor(rows).tolist() == [[0, 1], [4, 5], [8, 9]]
    assert names.ODD_ROWS.tensor(rows).tolist() == [[2, 3], [6, 7]]


def test_every_rule_uses_known_transforms():
    tables = [v for v in vars(names).values() if isinstance(v, list) and v and isinstance(v[0], names.Rule)]
    assert tables
    for table in tables:
        for rule in table:
            assert all(t in TRANSFORMS for t in rule.transforms), rule

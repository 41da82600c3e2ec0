"""Integer rounding, spelled once: tokens to blocks, counts to power-of-two buckets."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in exact integer arithmetic."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()

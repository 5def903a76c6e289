//! A binary min-heap laid out exactly like CPython's `heapq` (same sift algorithm, same
//! strict `<` comparisons), so that the array order is the authors' array order.
//!
//! The authors' simulators depend on that layout in two places: the hard stop is the time of
//! the *last array element* right after loading the trace (not the latest event), and Varuna's
//! `checkpointing_will_fail` walks the array front to back. Equal keys are not kept in
//! insertion order by `heapq`, so a `std::collections::BinaryHeap` or a (time, seq) order would
//! give different answers on ties.

/// Items compare by a key; `heapq` uses `<` only.
pub(crate) trait HeapKey {
    fn key(&self) -> (i64, u8);
}

fn less<T: HeapKey>(a: &T, b: &T) -> bool {
    a.key() < b.key()
}

#[derive(Debug, Clone, Default)]
pub(crate) struct PyHeap<T> {
    items: Vec<T>,
}

impl<T: HeapKey> PyHeap<T> {
    pub fn new() -> PyHeap<T> {
        PyHeap { items: Vec::new() }
    }

    /// The array, front to back (what `for e in heap` sees).
    pub fn as_slice(&self) -> &[T] {
        &self.items
    }

    /// `heapq.heappush`.
    pub fn push(&mut self, item: T) {
        self.items.push(item);
        let last = self.items.len() - 1;
        self.sift_down(0, last);
    }

    /// `heapq.heappop`.
    pub fn pop(&mut self) -> Option<T> {
        let last = self.items.pop()?;
        if self.items.is_empty() {
            return Some(last);
        }
        let top = std::mem::replace(&mut self.items[0], last);
        self.sift_up(0);
        Some(top)
    }

    /// `heapq.heapify`: may reorder equal items even in an array that already is a heap.
    pub fn heapify(&mut self) {
        for i in (0..self.items.len() / 2).rev() {
            self.sift_up(i);
        }
    }

    /// CPython's `_siftdown`: move the item at `pos` towards the root while it is smaller.
    fn sift_down(&mut self, start: usize, mut pos: usize) {
        while pos > start {
            let parent = (pos - 1) >> 1;
            if less(&self.items[pos], &self.items[parent]) {
                self.items.swap(pos, parent);
                pos = parent;
            } else {
                break;
            }
        }
    }

    /// CPython's `_siftup`: bubble the smaller child up all the way to a leaf, then sift the
    /// original item back down from there.
    fn sift_up(&mut self, mut pos: usize) {
        let end = self.items.len();
        let start = pos;
        let mut child = 2 * pos + 1;
        while child < end {
            let right = child + 1;
            if right < end && !less(&self.items[child], &self.items[right]) {
                child = right;
            }
            self.items.swap(pos, child);
            pos = child;
            child = 2 * pos + 1;
        }
        self.sift_down(start, pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Item(i64, u8, u32);
    impl HeapKey for Item {
        fn key(&self) -> (i64, u8) {
            (self.0, self.1)
        }
    }

    fn tags(h: &PyHeap<Item>) -> Vec<u32> {
        h.as_slice().iter().map(|i| i.2).collect()
    }

    /// Array layouts printed by CPython 3.11 `heapq` for the same pushes, heapify and pop.
    #[test]
    fn matches_cpython_heapq_layouts() {
        let mut h = PyHeap::new();
        for (i, k) in [5, 3, 8, 3, 1, 9, 3].into_iter().enumerate() {
            h.push(Item(k, 1, i as u32));
        }
        assert_eq!(tags(&h), vec![4, 1, 6, 0, 3, 5, 2]);
        // heapify reorders the two equal 3s that sit parent/child.
        h.heapify();
        assert_eq!(tags(&h), vec![4, 3, 6, 0, 1, 5, 2]);
        assert_eq!(h.pop().map(|i| i.2), Some(4));
        assert_eq!(tags(&h), vec![6, 3, 2, 0, 1, 5]);
        let mut popped = Vec::new();
        while let Some(i) = h.pop() {
            popped.push(i.0);
        }
        assert_eq!(popped, vec![3, 3, 3, 5, 8, 9]);
    }

    #[test]
    fn heapify_moves_equal_items() {
        // Three equal items: `_siftup` takes the right child when the left is not smaller,
        // so heapify of an already valid heap is not the identity on ties.
        let mut h = PyHeap::new();
        for t in 0..3 {
            h.push(Item(7, 2, t));
        }
        assert_eq!(tags(&h), vec![0, 1, 2]);
        h.heapify();
        assert_eq!(tags(&h), vec![2, 1, 0]);
    }
}

//! A table from descriptor number to what the library knows of it, sharded so that
//! threads driving different descriptors share no lock.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use libc::c_int;

/// Shards of a descriptor table: descriptor `fd` lives in shard `fd % SHARDS`, slot
/// `fd / SHARDS`.
const SHARDS: usize = 64;

/// One shard: its own lock on its own cache lines (two, against the adjacent-line
/// prefetcher), so that threads driving different descriptors do not pass one lock's
/// line between their cores on every call (the kernel's own descriptor look-up
/// shares nothing either). One lock for a whole process's table cost a two-thread
/// ping-pong 97 ns per call against 22 ns in two processes.
#[repr(align(128))]
struct Shard<T> {
    fds: RwLock<Vec<Option<T>>>,
}

/// A table from descriptor to shared object, read on every interposed call: while
/// it is empty a lookup is one relaxed load (no lock).
pub struct FdTable<T> {
    live: AtomicUsize,
    /// Counts the table's changes (every insert and removal, bumped after it): a
    /// copy of an entry taken when it read `g` is still the entry while it reads
    /// `g` (see [`FdTable::generation`]).
    changes: AtomicU64,
    shards: [Shard<T>; SHARDS],
}

impl<T: Shared> FdTable<T> {
    /// An empty table (usable in a `static`).
    pub const fn new() -> Self {
        FdTable {
            live: AtomicUsize::new(0),
            changes: AtomicU64::new(0),
            shards: [const { Shard { fds: RwLock::new(Vec::new()) } }; SHARDS],
        }
    }

    #[inline]
    fn read(&self, shard: usize) -> std::sync::RwLockReadGuard<'_, Vec<Option<T>>> {
        self.shards[shard].fds.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self, shard: usize) -> std::sync::RwLockWriteGuard<'_, Vec<Option<T>>> {
        self.shards[shard].fds.write().unwrap_or_else(|e| e.into_inner())
    }

    /// What `fd` refers to, if anything.
    #[inline]
    pub fn lookup(&self, fd: c_int) -> Option<T> {
        if self.live.load(Ordering::Relaxed) == 0 || fd < 0 {
            return None;
        }
        let (shard, slot) = place(fd);
        self.read(shard).get(slot).and_then(|c| c.clone())
    }

    /// The table's change count: read it before a [`FdTable::lookup`], and what
    /// that lookup found is what the descriptor refers to for as long as the count
    /// reads the same (a cache of entries checks it instead of taking the lock).
    #[inline]
    pub fn generation(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// One change made (under its shard's write lock, before the lock goes).
    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::Release);
    }

    /// True if any descriptor is in the table.
    pub fn any_live(&self) -> bool {
        self.live.load(Ordering::Relaxed) != 0
    }

    /// Registers `fd` as (another descriptor of) `v`; returns what `fd` referred to.
    pub fn insert(&self, fd: c_int, v: T) -> Option<T> {
        if fd < 0 {
            return None;
        }
        let (shard, slot) = place(fd);
        let mut t = self.write(shard);
        if t.len() <= slot {
            t.resize(slot + 1, None);
        }
        let old = t[slot].replace(v);
        if old.is_none() {
            self.live.fetch_add(1, Ordering::Relaxed);
        }
        self.changed();
        old
    }

    /// Removes `fd`; returns what it referred to.
    pub fn remove(&self, fd: c_int) -> Option<T> {
        if self.live.load(Ordering::Relaxed) == 0 || fd < 0 {
            return None;
        }
        let (shard, slot) = place(fd);
        let mut t = self.write(shard);
        let old = t.get_mut(slot).and_then(|c| c.take());
        if old.is_some() {
            self.live.fetch_sub(1, Ordering::Relaxed);
            self.changed();
        }
        old
    }

    /// Removes `fd` if what it refers to passes `keep_out`; returns what it removed.
    pub fn remove_if(&self, fd: c_int, keep_out: impl FnOnce(&T) -> bool) -> Option<T> {
        if self.live.load(Ordering::Relaxed) == 0 || fd < 0 {
            return None;
        }
        let (shard, slot) = place(fd);
        let mut t = self.write(shard);
        let entry = t.get_mut(slot)?;
        if !entry.as_ref().is_some_and(keep_out) {
            return None;
        }
        self.live.fetch_sub(1, Ordering::Relaxed);
        let old = entry.take();
        self.changed();
        old
    }

    /// Removes every descriptor of `v`; returns how many there were.
    pub fn remove_all(&self, v: &T) -> usize {
        let mut removed = 0;
        for shard in 0..SHARDS {
            let mut t = self.write(shard);
            for slot in t.iter_mut() {
                if slot.as_ref().is_some_and(|c| c.same(v)) {
                    *slot = None;
                    self.live.fetch_sub(1, Ordering::Relaxed);
                    self.changed();
                    removed += 1;
                }
            }
        }
        removed
    }

    /// Every descriptor in the table with what it refers to, by descriptor.
    pub fn entries(&self) -> Vec<(c_int, T)> {
        if !self.any_live() {
            return Vec::new();
        }
        let mut v = Vec::new();
        for shard in 0..SHARDS {
            let t = self.read(shard);
            v.extend(
                t.iter()
                    .enumerate()
                    .filter_map(|(slot, c)| Some(((slot * SHARDS + shard) as c_int, c.clone()?))),
            );
        }
        v.sort_by_key(|e| e.0);
        v
    }

    /// Every distinct object in the table (for fork and exit).
    pub fn all(&self) -> Vec<T> {
        if !self.any_live() {
            return Vec::new();
        }
        let mut v: Vec<T> = Vec::new();
        for shard in 0..SHARDS {
            for c in self.read(shard).iter().flatten() {
                if !v.iter().any(|x| x.same(c)) {
                    v.push(c.clone());
                }
            }
        }
        v
    }

    /// Takes every shard's write lock (in shard order, the only order in which more
    /// than one is ever held), for `fork`.
    pub fn write_all(&self) -> Vec<std::sync::RwLockWriteGuard<'_, Vec<Option<T>>>> {
        (0..SHARDS).map(|shard| self.write(shard)).collect()
    }
}

fn place(fd: c_int) -> (usize, usize) {
    let fd = fd as usize;
    (fd % SHARDS, fd / SHARDS)
}

/// What a table holds for a descriptor: cheap to clone (a reference count) and
/// compared by identity (two descriptors of one socket hold the same object).
pub trait Shared: Clone {
    /// True if `self` and `other` are the same object.
    fn same(&self, other: &Self) -> bool;
}

impl<T> Shared for Arc<T> {
    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(self, other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_found_replaced_and_removed_by_descriptor_and_by_identity() {
        let t: FdTable<Arc<u32>> = FdTable::new();
        assert!(t.lookup(3).is_none() && !t.any_live());
        let a = Arc::new(1);
        let b = Arc::new(2);
        // Descriptors in different shards and slots, and one far beyond the first.
        for fd in [3, 3 + SHARDS as c_int, 1000] {
            assert!(t.insert(fd, a.clone()).is_none());
        }
        assert!(t.insert(7, b.clone()).is_none());
        assert!(t.insert(7, b.clone()).is_some_and(|o| o.same(&b)), "a replaced entry is handed back");
        assert_eq!(
            t.entries().iter().map(|e| e.0).collect::<Vec<_>>(),
            vec![3, 7, 3 + SHARDS as c_int, 1000]
        );
        assert_eq!(t.all().len(), 2, "distinct objects");
        assert!(t.remove_if(7, |v| **v == 1).is_none(), "the predicate keeps what it refuses");
        assert!(t.lookup(7).is_some());
        assert_eq!(t.remove_all(&a), 3);
        assert!(t.lookup(1000).is_none() && t.lookup(3).is_none());
        assert!(t.remove(7).is_some_and(|o| o.same(&b)));
        assert!(!t.any_live(), "every entry counted out");
        assert!(t.lookup(-1).is_none() && t.insert(-1, a).is_none());
    }

    /// A cache of entries trusts a copy while the change count reads the same: every
    /// change that can make a copy stale moves it, and a look-up or a refused
    /// removal does not.
    #[test]
    fn every_change_moves_the_generation_and_nothing_else_does() {
        let t: FdTable<Arc<u32>> = FdTable::new();
        let a = Arc::new(1);
        fn changed(t: &FdTable<Arc<u32>>, g: &mut u64, what: &str) {
            let now = t.generation();
            assert!(now > *g, "{what} left the generation at {g}");
            *g = now;
        }
        let mut g = t.generation();
        t.insert(5, a.clone());
        changed(&t, &mut g, "an insert");
        t.insert(5, a.clone());
        changed(&t, &mut g, "a replacement");
        let before = t.generation();
        assert!(t.lookup(5).is_some() && t.remove_if(5, |_| false).is_none() && t.remove(6).is_none());
        assert_eq!(t.generation(), before, "look-ups and refused removals change nothing");
        t.remove_if(5, |_| true);
        changed(&t, &mut g, "a removal by predicate");
        t.insert(7, a.clone());
        g = t.generation();
        t.remove(7);
        changed(&t, &mut g, "a removal");
        t.insert(8, a.clone());
        g = t.generation();
        assert_eq!(t.remove_all(&a), 1);
        changed(&t, &mut g, "a removal by identity");
    }
}

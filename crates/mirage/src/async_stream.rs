//! A generation as an async `Stream` (feature `async`): the token steps run
//! on a thread of their own, since each is a blocking forward pass, and
//! the pieces reach the task through a queue that wakes it. Executor-
//! agnostic (only `futures-core`'s trait).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;

use mirage_runtime::{Generation, TokenPiece};

use crate::error::Result;
use crate::loaded::{LoadedSession, LoadedStream};

#[derive(Default)]
struct State {
    queue: VecDeque<Result<TokenPiece>>,
    /// Set when the generation ended: the session and the result.
    done: Option<(LoadedSession, Generation)>,
    ended: bool,
    cancelled: bool,
    waker: Option<Waker>,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic on the generation thread leaves the queue consistent.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// The pieces of one generation as a [`futures_core::Stream`]. Dropping it
/// stops the generation after the token step in flight.
pub struct AsyncTokenStream {
    state: Arc<Mutex<State>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for AsyncTokenStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncTokenStream").finish_non_exhaustive()
    }
}

impl LoadedStream {
    /// Runs the generation on its own thread and hands its pieces to an
    /// async task ([`AsyncTokenStream`]).
    pub fn into_async(self) -> AsyncTokenStream {
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let thread = std::thread::spawn(move || {
            let mut stream = self;
            loop {
                if lock(&shared).cancelled {
                    break;
                }
                let item = stream.next();
                let mut s = lock(&shared);
                let end = item.is_none();
                if let Some(item) = item {
                    s.queue.push_back(item);
                }
                if let Some(w) = s.waker.take() {
                    w.wake();
                }
                if end {
                    break;
                }
            }
            let done = stream.finish();
            let mut s = lock(&shared);
            s.done = Some(done);
            s.ended = true;
            if let Some(w) = s.waker.take() {
                w.wake();
            }
        });
        AsyncTokenStream {
            state,
            thread: Some(thread),
        }
    }
}

impl futures_core::Stream for AsyncTokenStream {
    type Item = Result<TokenPiece>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut s = lock(&self.state);
        if let Some(item) = s.queue.pop_front() {
            return Poll::Ready(Some(item));
        }
        if s.ended {
            return Poll::Ready(None);
        }
        s.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl AsyncTokenStream {
    /// Stops the generation (if it still runs: after the token step in
    /// flight, which this waits for) and gives back the session, ready for
    /// the next turn, with the result.
    pub fn finish(mut self) -> (LoadedSession, Generation) {
        lock(&self.state).cancelled = true;
        if let Some(t) = self.thread.take() {
            // The thread only panics if the engine does; its state is then
            // gone with it.
            if let Err(p) = t.join() {
                std::panic::resume_unwind(p);
            }
        }
        lock(&self.state)
            .done
            .take()
            .expect("the generation thread leaves its result")
    }
}

impl Drop for AsyncTokenStream {
    fn drop(&mut self) {
        lock(&self.state).cancelled = true;
    }
}

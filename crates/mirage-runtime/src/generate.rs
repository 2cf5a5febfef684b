//! Generation one token at a time: the state [`Session::generate_from`]
//! loops over, and [`TokenStream`], an iterator over the generated tokens.
//!
//! Each step samples from the logits the last forward pass left (under the
//! constraint, when there is one), decodes the token's text (whole UTF-8
//! only, stop strings held back until they cannot match), and hands it out;
//! the token is fed to the model at the start of the next step, so a
//! consumer that stops early leaves the cache without the last token, as a
//! callback returning `false` does.

use std::time::Instant;

use mirage_tokenizer::StreamDecoder;

use crate::backend::Backend;
use crate::engine::{
    sample_next, ActiveConstraint, GenerateParams, Generation, GenerationStats, Session, StopReason,
};
use crate::error::{Result, RuntimeError};
use crate::sampling::{token_logprob, Sampler, StopCheck, StopStrings, TokenLogprob};

/// One step of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenPiece {
    /// The generated token; `None` for the last piece, which carries text
    /// held back until the end (an unfinished UTF-8 character, a possible
    /// stop-string prefix).
    pub token: Option<u32>,
    /// Text this step completes; may be empty (part of a character, or
    /// held back for a stop string).
    pub text: String,
    /// The token's log-probability, when [`GenerateParams::logprobs`]
    /// asked for it.
    pub logprob: Option<TokenLogprob>,
}

/// Where a generation stands (see the module doc).
pub(crate) struct GenState {
    sampler: Sampler,
    constraint: Option<ActiveConstraint>,
    stops: StopStrings,
    decoder: StreamDecoder,
    text: String,
    emitted: usize,
    generated: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    want_logprobs: Option<usize>,
    max_tokens: usize,
    /// Sampled and handed out, not yet fed.
    pending: Option<u32>,
    decode_steps: usize,
    stop: Option<StopReason>,
    tail_done: bool,
    prompt_tokens: usize,
    prompt_secs: f64,
    t1: Instant,
}

impl GenState {
    /// Ends the generation before the model did (the pending token is not
    /// fed).
    pub(crate) fn stop_early(&mut self, reason: StopReason) {
        self.pending = None;
        self.stop.get_or_insert(reason);
    }

    /// The result so far (text up to what was handed out plus any tail).
    pub(crate) fn finish(mut self) -> Generation {
        if !self.tail_done && self.stop != Some(StopReason::StopString) {
            self.text.push_str(&self.decoder.finish());
        }
        Generation {
            text: self.text,
            tokens: self.generated,
            stats: GenerationStats {
                prompt_tokens: self.prompt_tokens,
                generated_tokens: 0,
                decode_steps: self.decode_steps,
                prompt_secs: self.prompt_secs,
                decode_secs: self.t1.elapsed().as_secs_f64(),
                stop_reason: self.stop.unwrap_or(StopReason::MaxTokens),
            },
            logprobs: self.logprobs,
        }
        .with_counts()
    }
}

impl Generation {
    fn with_counts(mut self) -> Generation {
        self.stats.generated_tokens = self.tokens.len();
        self
    }
}

impl<'e, B: Backend> Session<'e, B> {
    /// Feeds `context` (reusing the cached prefix) and starts generating
    /// after it.
    pub(crate) fn start_generation(
        &mut self,
        context: &[u32],
        params: &GenerateParams,
    ) -> Result<GenState> {
        params.validate()?;
        let t0 = Instant::now();
        let before = self
            .tokens
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len().saturating_sub(1));
        self.feed_context(context)?;
        let prompt_secs = t0.elapsed().as_secs_f64();
        Ok(GenState {
            sampler: Sampler::new(params.sampling.clone()),
            constraint: ActiveConstraint::start(params, self.logits.len())?,
            stops: StopStrings::new(params.stop.iter().cloned()),
            decoder: StreamDecoder::new(),
            text: String::new(),
            emitted: 0,
            generated: Vec::new(),
            logprobs: Vec::new(),
            want_logprobs: params.logprobs,
            max_tokens: params.max_tokens,
            pending: None,
            decode_steps: 0,
            stop: None,
            tail_done: false,
            prompt_tokens: context.len() - before,
            prompt_secs,
            t1: Instant::now(),
        })
    }

    /// The next piece, or `None` when the generation has ended (then
    /// `state.stop` says why).
    pub(crate) fn next_piece(&mut self, g: &mut GenState) -> Result<Option<TokenPiece>> {
        if g.stop.is_none() {
            // The last sample is fed even after the last token, so that the
            // cache holds the whole reply and a chat can continue after it.
            if let Some(t) = g.pending.take() {
                match self.feed(&[t]) {
                    Ok(_) => g.decode_steps += 1,
                    Err(RuntimeError::ContextFull { .. }) => g.stop = Some(StopReason::ContextFull),
                    Err(e) => return Err(e),
                }
            }
        }
        if g.stop.is_none() && g.generated.len() >= g.max_tokens {
            g.stop = Some(StopReason::MaxTokens);
        }
        if let Some(reason) = g.stop {
            if g.tail_done || reason == StopReason::StopString {
                return Ok(None);
            }
            g.tail_done = true;
            g.text.push_str(&g.decoder.finish());
            if g.text.len() > g.emitted {
                let text = g.text[g.emitted..].to_string();
                g.emitted = g.text.len();
                return Ok(Some(TokenPiece {
                    token: None,
                    text,
                    logprob: None,
                }));
            }
            return Ok(None);
        }
        let tokenizer = self.engine.tokenizer();
        let token = match sample_next(
            &mut g.sampler,
            &self.logits,
            &self.tokens,
            g.constraint.as_mut(),
        )? {
            Some(t) if !tokenizer.is_eog(t) => t,
            // The constraint allows nothing more, or the model ended.
            _ => {
                g.stop = Some(StopReason::EndOfGeneration);
                return self.next_piece(g);
            }
        };
        if let Some(c) = g.constraint.as_mut() {
            c.accept(token)?;
        }
        let logprob = g
            .want_logprobs
            .map(|n| token_logprob(&self.logits, token, n));
        if let Some(lp) = &logprob {
            g.logprobs.push(lp.clone());
        }
        g.generated.push(token);
        g.text.push_str(&g.decoder.push_token(tokenizer, token));
        let text = match g.stops.check(&g.text) {
            StopCheck::Stop(at) => {
                g.text.truncate(at);
                g.stop = Some(StopReason::StopString);
                let t = g.text.get(g.emitted..).unwrap_or("").to_string();
                g.emitted = g.text.len();
                t
            }
            StopCheck::Emit(safe) => {
                g.pending = Some(token);
                let t = g.text[g.emitted.min(safe)..safe].to_string();
                g.emitted = g.emitted.max(safe);
                t
            }
        };
        Ok(Some(TokenPiece {
            token: Some(token),
            text,
            logprob,
        }))
    }

    /// Appends `prompt` to the conversation (as [`Session::generate`]) and
    /// returns an iterator over the generated tokens. The stream owns the
    /// session; [`TokenStream::finish`] gives back the session and the
    /// [`Generation`].
    pub fn stream(self, prompt: &str, params: &GenerateParams) -> Result<TokenStream<'e, B>> {
        let mut context = self.tokens.clone();
        context.extend(self.engine.encode(prompt, self.tokens.is_empty())?);
        self.stream_from(&context, params)
    }

    /// [`Session::stream`] after exactly `context`.
    pub fn stream_from(
        mut self,
        context: &[u32],
        params: &GenerateParams,
    ) -> Result<TokenStream<'e, B>> {
        let state = self.start_generation(context, params)?;
        Ok(TokenStream {
            session: self,
            state: Some(state),
        })
    }
}

/// An iterator over the pieces of one generation (see [`TokenPiece`]);
/// with a session from `Engine::shared_session` it is `'static` and moves
/// into threads and async tasks. Dropping it early is stopping early.
pub struct TokenStream<'e, B: Backend> {
    session: Session<'e, B>,
    state: Option<GenState>,
}

impl<B: Backend> std::fmt::Debug for TokenStream<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStream")
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl<'e, B: Backend> Iterator for TokenStream<'e, B> {
    type Item = Result<TokenPiece>;

    fn next(&mut self) -> Option<Result<TokenPiece>> {
        let state = self.state.as_mut()?;
        match self.session.next_piece(state) {
            Ok(Some(p)) => Some(Ok(p)),
            Ok(None) => None,
            Err(e) => {
                state.stop_early(StopReason::EndOfGeneration);
                Some(Err(e))
            }
        }
    }
}

impl<'e, B: Backend> TokenStream<'e, B> {
    /// Ends the generation where it stands (the consumer's choice:
    /// [`StopReason::Callback`] unless it had ended) and returns the
    /// session, ready for the next turn, with the result.
    pub fn finish(mut self) -> (Session<'e, B>, Generation) {
        let mut state = self
            .state
            .take()
            .expect("a stream holds its state until finished");
        state.stop_early(StopReason::Callback);
        (self.session, state.finish())
    }
}

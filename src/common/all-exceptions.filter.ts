import { ArgumentsHost, Catch, ExceptionFilter, Logger } from '@nestjs/common';
import type { FastifyReply, FastifyRequest } from 'fastify';
import { monotonicMs } from './clock.js';
import { DomainError, ErrorCode } from './errors.js';
import { mapError } from './http-errors.js';

/** Answers about a hold's time running out: they say when the request reached this instance. */
const HOLD_TIME_CODES: ReadonlySet<string> = new Set([ErrorCode.HOLD_LOST, ErrorCode.HOLD_EXPIRED]);

/** How often the 503s of one dependency are logged at most: an outage answers every request so. */
export const UNAVAILABLE_LOG_GAP_MS = 10_000;

/** What failed beneath an error: the first cause that is not one of ours (a driver's error), if any. */
function rootCause(err: unknown): unknown {
  let cause = (err as { cause?: unknown } | null)?.cause;
  while (cause instanceof DomainError) cause = (cause as { cause?: unknown }).cause;
  return cause;
}

@Catch()
export class AllExceptionsFilter implements ExceptionFilter {
  private readonly logger = new Logger('Errors');
  /** By dependency and message: when such a 503 was last logged, and how many were answered since without a line. */
  private readonly unavailableSeen = new Map<string, { at: number; unlogged: number }>();

  /**
   * Logs a 503: the first of a dependency and kind, then at most one every UNAVAILABLE_LOG_GAP_MS, saying how many
   * were not logged in between (an outage under load logged a line for each request, over a thousand a second).
   */
  private unavailable(reqId: string, message: string, details: Record<string, unknown>, cause: unknown): void {
    const report = details.report as { error?: Record<string, { message?: unknown; status?: unknown }> } | undefined;
    // A readiness check's: what each failed check said.
    if (cause === undefined && report?.error) {
      cause = Object.entries(report.error)
        .map(([name, check]) => `${name}: ${String(check?.message ?? check?.status)}`)
        .join('; ');
    }
    const dependency =
      typeof details.dependency === 'string' ? details.dependency : report?.error ? Object.keys(report.error).sort().join(',') : 'unknown';
    // By message too (a fixed one for each kind of 503): a readiness probe's, or a plain refusal's, does not hide
    // another kind, a confirm whose outcome is unknown, say.
    const kind = `${dependency}\n${message}`;
    const now = monotonicMs();
    const seen = this.unavailableSeen.get(kind);
    if (seen !== undefined && now - seen.at < UNAVAILABLE_LOG_GAP_MS) {
      seen.unlogged++;
      return;
    }
    this.unavailableSeen.set(kind, { at: now, unlogged: 0 });
    const unlogged = seen?.unlogged ?? 0;
    const more = unlogged > 0 ? ` (${unlogged} more such 503s since the last such line)` : '';
    this.logger.warn({
      reqId,
      dependency,
      ...(unlogged > 0 && { unlogged }),
      msg: `${message}${cause === undefined ? '' : `: ${String(cause)}`}${more}`,
    });
  }

  catch(exception: unknown, host: ArgumentsHost): void {
    const http = host.switchToHttp();
    const reply = http.getResponse<FastifyReply>();
    const request = http.getRequest<FastifyRequest>();
    const reqId = request.id;
    const mapped = mapError(exception);
    const error = mapped.body.error;
    if (HOLD_TIME_CODES.has(error.code)) {
      // Whether a confirm came in time is judged against expiresAt: when this instance received it (by its
      // own clock) tells a caller whose request was late on the way from one the service failed.
      error.details = { ...error.details, receivedAt: new Date(request.receivedAtMs || Date.now()).toISOString() };
    }
    if (mapped.internal) {
      this.logger.error({ reqId, msg: 'unexpected error', stack: exception instanceof Error ? exception.stack : String(exception) });
    } else if (mapped.status === 503) {
      this.unavailable(reqId, error.message, error.details, rootCause(exception));
    }
    void reply.status(mapped.status).header('content-type', 'application/json; charset=utf-8').send(mapped.body);
  }
}

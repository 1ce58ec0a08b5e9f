import { ArgumentsHost, Catch, ExceptionFilter, Logger } from '@nestjs/common';
import type { FastifyReply, FastifyRequest } from 'fastify';
import { ErrorCode } from './errors.js';
import { mapError } from './http-errors.js';

/** Answers about a hold's time running out: they say when the request reached this instance. */
const HOLD_TIME_CODES: ReadonlySet<string> = new Set([ErrorCode.HOLD_LOST, ErrorCode.HOLD_EXPIRED]);

@Catch()
export class AllExceptionsFilter implements ExceptionFilter {
  private readonly logger = new Logger('Errors');

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
      const cause = (exception as { cause?: unknown }).cause;
      this.logger.warn({ reqId, msg: cause === undefined ? mapped.body.error.message : `${mapped.body.error.message}: ${String(cause)}` });
    }
    void reply.status(mapped.status).header('content-type', 'application/json; charset=utf-8').send(mapped.body);
  }
}

import { ArgumentsHost, Catch, ExceptionFilter, Logger } from '@nestjs/common';
import type { FastifyReply, FastifyRequest } from 'fastify';
import { mapError } from './http-errors.js';

@Catch()
export class AllExceptionsFilter implements ExceptionFilter {
  private readonly logger = new Logger('Errors');

  catch(exception: unknown, host: ArgumentsHost): void {
    const http = host.switchToHttp();
    const reply = http.getResponse<FastifyReply>();
    const reqId = http.getRequest<FastifyRequest>().id;
    const mapped = mapError(exception);
    if (mapped.internal) {
      this.logger.error({ reqId, msg: 'unexpected error', stack: exception instanceof Error ? exception.stack : String(exception) });
    } else if (mapped.status === 503) {
      this.logger.warn({ reqId, msg: `${mapped.body.error.message}: ${String((exception as { cause?: unknown }).cause ?? '')}` });
    }
    void reply.status(mapped.status).header('content-type', 'application/json; charset=utf-8').send(mapped.body);
  }
}

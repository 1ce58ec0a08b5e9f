import { Body, Controller, Delete, Get, Headers, HttpCode, Param, Post, Res } from '@nestjs/common';
import { ApiBody, ApiCreatedResponse, ApiHeader, ApiOkResponse, ApiOperation, ApiTags } from '@nestjs/swagger';
import type { FastifyReply } from 'fastify';
import { ActingFor, mustActFor, Roles } from '../common/auth.js';
import { ApiErrors } from '../common/api-errors.decorator.js';
import { ErrorCode } from '../common/errors.js';
import { NO_BODY, NoBodyPipe } from '../common/validation.js';
import { PoolParams } from '../pools/pool.dto.js';
import { ConfirmDto, ConfirmResultDto, CreateReservationDto, ExtendDto, ReservationDto, ReservationParams } from './reservation.dto.js';
import { IDEMPOTENCY_KEY, ReservationsService } from './reservations.service.js';

/** The reserve's route, as Fastify names it (app.factory.ts checks its Idempotency-Key with its path and body). */
export const RESERVE_ROUTE = '/v1/pools/:pool/reservations';

@ApiTags('reservations')
@Controller()
export class ReservationsController {
  constructor(private readonly reservations: ReservationsService) {}

  @Post(RESERVE_ROUTE.slice(1))
  @Roles('client')
  @ApiOperation({ summary: 'Hold `count` free items for an owner, all or nothing' })
  @ApiHeader({
    name: 'Idempotency-Key',
    required: false,
    description:
      'Repeat the call with the same key and body to get the same reservation (200); 1-255 visible ASCII characters. ' +
      'Remembered for IDEMPOTENCY_TTL_MS (24 h by default) from the first call; for a reservation that was confirmed, ' +
      'also after Redis lost its data',
    schema: { type: 'string', pattern: IDEMPOTENCY_KEY.source, minLength: 1, maxLength: 255 },
  })
  @ApiCreatedResponse({ type: ReservationDto, description: 'Items held' })
  @ApiOkResponse({ type: ReservationDto, description: 'Replay of an earlier call with the same Idempotency-Key' })
  @ApiErrors(
    ErrorCode.VALIDATION_FAILED,
    ErrorCode.POOL_NOT_FOUND,
    ErrorCode.POOL_EXHAUSTED,
    ErrorCode.IDEMPOTENCY_KEY_REUSED,
    ErrorCode.OWNER_QUOTA_EXCEEDED,
  )
  async reserve(
    @Param() params: PoolParams,
    @Body() dto: CreateReservationDto,
    @Headers('idempotency-key') idempotencyKey: string | undefined,
    @Res({ passthrough: true }) reply: FastifyReply,
    @ActingFor() actingFor: string | undefined,
  ): Promise<ReservationDto> {
    mustActFor(actingFor, dto.owner);
    // A reserve that may wait stops waiting when its caller hangs up.
    const hangUp = dto.waitMs ? watchHangUp(reply) : undefined;
    try {
      const answer = await this.reservations.reserve(params.pool, dto, idempotencyKey, hangUp?.signal);
      void reply.status(answer.created ? 201 : 200);
      return answer.reservation;
    } finally {
      hangUp?.stop();
    }
  }

  @Get('v1/reservations/:id')
  @Roles('client')
  @ApiOperation({ summary: 'A reservation and its state' })
  @ApiOkResponse({ type: ReservationDto, description: 'The reservation' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.RESERVATION_NOT_FOUND)
  async get(@Param() params: ReservationParams, @ActingFor() actingFor: string | undefined): Promise<ReservationDto> {
    await this.reservations.mustOwn(params.id, 'r', actingFor);
    return this.reservations.get(params.id);
  }

  @Post('v1/reservations/:id/extend')
  @Roles('client')
  @HttpCode(200)
  @ApiOperation({ summary: "Extend a live hold: expiresAt = now + ttlMs, capped by the pool's maxHoldTtlMs" })
  @ApiOkResponse({ type: ReservationDto, description: 'The reservation with its new expiresAt' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.RESERVATION_NOT_FOUND, ErrorCode.HOLD_EXPIRED, ErrorCode.RESERVATION_CLOSED)
  async extend(
    @Param() params: ReservationParams,
    @Body() dto: ExtendDto,
    @ActingFor() actingFor: string | undefined,
  ): Promise<ReservationDto> {
    await this.reservations.mustOwn(params.id, 'r', actingFor);
    return this.reservations.extend(params.id, dto.ttlMs);
  }

  @Post('v1/reservations/:id/confirm')
  @Roles('client')
  @HttpCode(200)
  @ApiOperation({ summary: 'Allocate the chosen items to the owner and free the rest (idempotent)' })
  @ApiOkResponse({ type: ConfirmResultDto, description: 'Confirmed (the same body for a repeat of the same confirm)' })
  @ApiErrors(
    ErrorCode.VALIDATION_FAILED,
    ErrorCode.RESERVATION_NOT_FOUND,
    ErrorCode.HOLD_LOST,
    ErrorCode.HOLD_EXPIRED,
    ErrorCode.RESERVATION_CLOSED,
    ErrorCode.NOT_IN_RESERVATION,
  )
  async confirm(
    @Param() params: ReservationParams,
    @Body() dto: ConfirmDto,
    @ActingFor() actingFor: string | undefined,
  ): Promise<ConfirmResultDto> {
    await this.reservations.mustOwn(params.id, 'r', actingFor);
    return this.reservations.confirm(params.id, dto.resourceIds);
  }

  @Delete('v1/reservations/:id')
  @Roles('client')
  @ApiOperation({ summary: 'Release every held item of the reservation at once (idempotent)' })
  @ApiOkResponse({ type: ReservationDto, description: 'The reservation, released (also when it already was)' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.RESERVATION_NOT_FOUND, ErrorCode.RESERVATION_CLOSED)
  @ApiBody(NO_BODY)
  async release(
    @Param() params: ReservationParams,
    @Body(NoBodyPipe) _body: unknown,
    @ActingFor() actingFor: string | undefined,
  ): Promise<ReservationDto> {
    await this.reservations.mustOwn(params.id, 'r', actingFor);
    return this.reservations.release(params.id);
  }
}

/**
 * Aborts when the request's connection closes, watched until stop() (called once the answer is ready, before it is
 * written). The socket, not the response: a pipelined request's response has none yet, and is not told; and one
 * already closed when the handler starts counts.
 */
function watchHangUp(reply: FastifyReply): { signal: AbortSignal; stop: () => void } {
  const gone = new AbortController();
  const socket = reply.request.raw.socket;
  if (socket.destroyed) {
    gone.abort();
    return { signal: gone.signal, stop: () => undefined };
  }
  // One listener a socket, whatever the number of its waiting reserves (pipelined on one connection, each added
  // one, and Node warned of a leak past 10).
  let waiting = watchers.get(socket);
  if (waiting === undefined) {
    const controllers = new Set<AbortController>();
    const hungUp = (): void => {
      watchers.delete(socket);
      for (const controller of controllers) controller.abort();
    };
    waiting = { controllers, stop: () => socket.off('close', hungUp) };
    watchers.set(socket, waiting);
    socket.once('close', hungUp);
  }
  const own = waiting;
  own.controllers.add(gone);
  return {
    signal: gone.signal,
    stop: () => {
      own.controllers.delete(gone);
      if (own.controllers.size === 0 && watchers.get(socket) === own) {
        watchers.delete(socket);
        own.stop();
      }
    },
  };
}

/** The waiting reserves of each socket, told together when it closes (watchHangUp). */
const watchers = new WeakMap<object, { controllers: Set<AbortController>; stop: () => void }>();
